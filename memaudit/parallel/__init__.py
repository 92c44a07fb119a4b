"""4D hybrid parallelism (AxoNN): data x 3D tensor parallelism on torch.distributed.

References:
  Singh, Sathwik, Bhatele et al., "A 4D Hybrid Algorithm to Scale Parallel Training to
  Thousands of GPUs" (AxoNN), SC'24.
"""
