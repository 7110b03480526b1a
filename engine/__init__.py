"""The engine: every served model in one process, one step loop over them (llm_engine.py), and
an async front for servers (async_engine.py). What the layers above may use is exported here;
the rest of the package is its inside."""
from .async_engine import AsyncEngine, EngineFailure, Stopped
from .config import QUANT_SCHEMES, EngineConfig, ModelEntry, SpecConfig, ThinkingConfig
from .early_exit import settled
from .llm_engine import Completion, LLMEngine, StepOutput
from .prompter import Prompter, Prompters
from .sampling_params import MIN_SEED, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams, ThinkingExit
from .sequence import KVWindow, Probe
from .worker import default_quant

__all__ = ["AsyncEngine", "Completion", "EngineConfig", "EngineFailure", "KVWindow", "LLMEngine", "MIN_SEED",
           "MIN_TEMPERATURE", "MIN_TOP_P", "ModelEntry", "Probe", "Prompter", "Prompters", "QUANT_SCHEMES",
           "SamplingParams", "SpecConfig", "StepOutput", "Stopped", "ThinkingConfig", "ThinkingExit", "default_quant",
           "settled"]
