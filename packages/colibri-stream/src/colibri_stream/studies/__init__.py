"""Measurement code (benchmarks, policy and prefetch studies, workloads, disk bandwidth). The runtime never imports it."""
