"""dispatch: picks the implementation (cute, triton, reference) per device, format and shape."""
