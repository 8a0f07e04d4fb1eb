"""Codecs for what peers send: none, fp16, bf16, int8, int4, int4-int8, arc-topk:DENSITY."""

from moshpeer.compression.codec import Codec, Compression, available, get_compression, register

__all__ = ["Codec", "Compression", "available", "get_compression", "register"]
