"""CPU kernels for decoding: ``linear.py`` routes small-row ``nn.Linear`` calls through the fastest measured kernel."""
