"""torch.compile in the loop: its options, the wrapping order, the compiled optimizer step."""
