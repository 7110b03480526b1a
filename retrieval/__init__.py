"""Retrieval: parse and chunk documents, embed them, search per-tenant collections, and trim
the hits to a context budget as a prompt whose prefix the engine's cache can reuse."""
from .collection import Collection, CollectionConfig, CollectionStore, IngestReport
from .context import OverBudget, Passage, RagContext, rag_context
from .documents import chunk, load, parse
from .embedder import Embedder
from .prompt import DEFAULT_INSTRUCTIONS, Prompt, build_prompt, canonical, system_text
from .select import Selector
from .trim import Dropped, TrimResult, trim
from .types import Chunk, Document, HFTokenizer, RetrievalError, SearchHit, TokenCounter

__all__ = ["Chunk", "Passage", "Collection", "CollectionConfig", "DEFAULT_INSTRUCTIONS", "Document", "Dropped",
           "Embedder", "HFTokenizer", "IngestReport", "OverBudget", "Prompt", "RagContext", "RetrievalError",
           "SearchHit", "Selector", "CollectionStore", "TokenCounter", "TrimResult", "build_prompt", "canonical",
           "chunk", "load", "parse", "rag_context", "system_text", "trim"]
