"""One file per strategy, each a small subclass of :class:`Strategy`."""
