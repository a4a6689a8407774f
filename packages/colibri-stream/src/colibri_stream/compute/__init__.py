"""Routed-expert compute: the streamed backend, int4 kernels and their repack, the dequant reference, the route choice."""

# "native": the native q4 kernel on the container's own bytes; "int4": torch's CPU int4 kernels;
# "dequant": dense matmuls; "auto": timed here (choice.py). Torch-free, for the CLI's --help.
COMPUTE_CHOICES = ("auto", "native", "int4", "dequant")
