"""Retrieval: parse and chunk documents, embed them, search per-tenant collections, and trim
the hits to a context budget as a prompt whose prefix the engine's cache can reuse."""
from .collection import Collection, CollectionConfig, IngestReport, Store
from .documents import chunk, load, parse
from .embedder import Embedder
from .prompt import DEFAULT_INSTRUCTIONS, Prompt, build_prompt, canonical, system_text
from .trim import Dropped, TrimResult, trim
from .types import Chunk, Document, HFTokenizer, RetrievalError, SearchHit, Tokenizer

__all__ = ["Chunk", "Collection", "CollectionConfig", "DEFAULT_INSTRUCTIONS", "Document", "Dropped",
           "Embedder", "HFTokenizer", "IngestReport", "Prompt", "RetrievalError", "SearchHit", "Store",
           "Tokenizer", "TrimResult", "build_prompt", "canonical", "chunk", "load", "parse", "system_text",
           "trim"]
