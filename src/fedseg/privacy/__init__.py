"""What a site's messages reveal, and how fedseg limits it: differential privacy (``dp``: DP-SGD's
privatized gradients and clipped, noised updates; ``accountant``: ε per site)."""
