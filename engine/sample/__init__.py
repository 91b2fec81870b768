"""Every step's token choice: the sampler, the verifier and rejection sampling."""
