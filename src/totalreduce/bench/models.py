"""Parameter shapes of two reference models, for replaying one iteration's gradients.

Written out from the architectures (torchvision's ResNet-50, Hugging Face's BERT-base
encoder with pooler), not loaded: nothing is downloaded and torch is not needed.
The lists are in forward order; backward produces gradients in reverse.
"""

from __future__ import annotations

Shape = tuple[int, ...]


def _conv_bn(shapes: list[Shape], cin: int, cout: int, k: int) -> None:
    shapes.append((cout, cin, k, k))
    shapes.append((cout,))  # batch-norm weight
    shapes.append((cout,))  # batch-norm bias


def resnet50_shapes() -> list[Shape]:
    """161 tensors, 25,557,032 parameters."""
    shapes: list[Shape] = []
    _conv_bn(shapes, 3, 64, 7)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            _conv_bn(shapes, cin, width, 1)
            _conv_bn(shapes, width, width, 3)
            _conv_bn(shapes, width, width * 4, 1)
            if b == 0:  # projection shortcut
                _conv_bn(shapes, cin, width * 4, 1)
            cin = width * 4
    shapes.append((1000, 2048))
    shapes.append((1000,))
    return shapes


def bert_base_shapes() -> list[Shape]:
    """199 tensors, 109,482,240 parameters (embeddings, 12 layers, pooler)."""
    h, ff = 768, 3072
    shapes: list[Shape] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        for _qkvo in range(4):
            shapes += [(h, h), (h,)]
        shapes += [(h,), (h,)]            # attention output LayerNorm
        shapes += [(ff, h), (ff,), (h, ff), (h,)]
        shapes += [(h,), (h,)]            # output LayerNorm
    shapes += [(h, h), (h,)]              # pooler
    return shapes


MODELS = {"resnet50": resnet50_shapes, "bert-base": bert_base_shapes}
