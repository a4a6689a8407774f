"""Routing traces: the event, the trace file format (ROUTING_TRACE.md), capture from transformers MoE models."""
