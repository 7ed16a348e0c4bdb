"""ema: an exponential moving average of the weights, updated once per real optimizer update."""
