"""Request and response models, one family per resource."""
