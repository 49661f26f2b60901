"""Row operations of the runtime: moving, expanding and reducing rows of token and
expert-grouped buffers, each as a torch reference and a Triton kernel (one concept a file)."""
