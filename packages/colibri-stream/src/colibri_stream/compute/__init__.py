"""Routed-expert compute: the streamed backend, int4 kernels and their repack, the dequant reference, the route choice."""
