"""The device worker thread: the only place that touches model tensors."""
