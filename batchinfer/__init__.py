"""batchinfer: offline batch inference for GDN-hybrid language models."""
__version__ = "0.1.0"
