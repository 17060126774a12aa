"""How the model computes: mixed precision, fp8 layers and ``torch.compile``."""
