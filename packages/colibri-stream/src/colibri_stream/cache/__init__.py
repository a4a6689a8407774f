"""The expert cache: slots under the RAM budget, the slab they live in, eviction policies, prefetch, offline replay."""
