"""Disk and memory plumbing: O_DIRECT reads, the I/O byte accounting, C-heap trimming."""
