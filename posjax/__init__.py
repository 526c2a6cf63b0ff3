"""posjax: TUPE, DeBERTa and ViT as pure Flax modules, with a sharded training system."""
from posjax.models.config import TextConfig, ViTConfig
from posjax.models.text import (TextEncoder, TextForMaskedLM, TextForSequenceClassification)
from posjax.models.vit import ViT

__all__ = ["TextConfig", "ViTConfig", "TextEncoder", "TextForMaskedLM",
           "TextForSequenceClassification", "ViT"]
