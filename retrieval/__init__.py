"""Retrieval: read files (text, Markdown, HTML, JSONL, PDF, Word), parse and chunk documents,
embed them, search per-tenant collections, and trim the hits to a context budget as a prompt
whose prefix the engine's cache can reuse."""
from .collection import Collection, CollectionConfig, CollectionStore, IngestReport
from .context import OverBudget, Passage, RagContext, rag_context
from .documents import chunk, parse
from .embedder import Embedder
from .files import BadFile, File, load, read, read_changed
from .prompt import DEFAULT_INSTRUCTIONS, Prompt, build_prompt, canonical, system_text
from .select import Selector
from .trim import Dropped, TrimResult, trim
from .types import Chunk, Document, HFTokenizer, RetrievalError, SearchHit, Span, TokenCounter

__all__ = ["BadFile", "Chunk", "Collection", "CollectionConfig", "CollectionStore", "DEFAULT_INSTRUCTIONS",
           "Document", "Dropped", "Embedder", "File", "HFTokenizer", "IngestReport", "OverBudget", "Passage",
           "Prompt", "RagContext", "RetrievalError", "SearchHit", "Selector", "Span", "TokenCounter", "TrimResult",
           "build_prompt", "canonical", "chunk", "load", "parse", "rag_context", "read", "read_changed", "system_text",
           "trim"]
