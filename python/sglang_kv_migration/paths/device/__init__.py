"""Same host, into the target's GPU: CUDA IPC buffers, the page-copy kernels and the
tier planning that reads each page where the source holds it (GPU or pinned host)."""
