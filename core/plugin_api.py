"""The public plugin API: every name a drafting method may import from the core.

A plugin (bundled or third-party) imports from this module only, so that the core's own
modules can move and change without breaking plugins: a name here keeps its meaning across
releases, and a name that must go stays one release with a deprecation warning. An
import-linter contract (``pyproject.toml``) holds the bundled plugins and the example plugin
to it. Grouped as a plugin uses them: registering, configuring, drafting, reading the
target's hidden states, storing weights, loading models, training.
"""

from .config import SpeculativeConfig, TreeDraftConfig, in_range
from .drafting.chain_stop import ChainStop
from .drafting.checkpoint import (
    SECTION,
    check_target,
    drafter_directory,
    head_rows,
    load_draft_vocab,
    load_state_checked,
    load_tensors,
    read_config,
    restricted_head,
    save_draft_vocab,
    save_tensors,
    target_signature,
)
from .drafting.feature_drafter import FeatureDrafter
from .drafting.hookspecs import hookimpl
from .drafting.interface import TREE_KIND, Drafter, DraftProposal, StepResult, TreeMask
from .drafting.last_state import LastStateDrafter
from .drafting.layers import ResBlock
from .drafting.runner import DraftInput, DraftRunner, causal_lm_forward, draft_attention
from .drafting.tree import StaticTree, ancestor_mask, prefix_trie
from .errors import FieldError, ModelLoadError
from .model.loading import EMBEDDED_NAME, load_causal_lm, load_tokenizer, resolve_model_dir
from .model.target import ATTENTION_NAME, TargetModel, TargetParts
from .plugins import DecodingType
from .sampler import pick_draft_token
from .sampler.lossy import RelaxedAcceptance, TypicalAcceptance
from .training import UNROLLED_ATTENTION, MethodTrainer, TrainBatch, draft_vocabulary, training_time_test

__all__ = [
    # registering a method: the hook marker and what register_decoding_types registers
    "hookimpl", "DecodingType",
    # configuring it: the base configurations, their validators and the errors they raise
    "SpeculativeConfig", "TreeDraftConfig", "in_range", "FieldError", "ModelLoadError",
    # drafting: the drafter base, its proposals and results, trees and draft-token picking
    "Drafter", "DraftProposal", "StepResult", "TreeMask", "StaticTree", "ancestor_mask", "prefix_trie",
    "TREE_KIND", "pick_draft_token", "ChainStop", "RelaxedAcceptance", "TypicalAcceptance",
    # drafters that read the target: its shared parts and the machinery that runs draft modules
    "TargetModel", "TargetParts", "ATTENTION_NAME", "FeatureDrafter", "LastStateDrafter", "DraftRunner",
    "DraftInput", "causal_lm_forward", "draft_attention", "ResBlock",
    # drafter files: reading, checking against the target, int8 rows, draft vocabularies
    "SECTION", "check_target", "drafter_directory", "head_rows", "load_draft_vocab", "load_state_checked",
    "load_tensors", "read_config", "restricted_head", "save_draft_vocab", "save_tensors", "target_signature",
    # models a drafter loads (a draft model beside the target)
    "EMBEDDED_NAME", "load_causal_lm", "load_tokenizer", "resolve_model_dir",
    # training (`specdec train`): a method's trainer and what the core shares between them
    "MethodTrainer", "TrainBatch", "UNROLLED_ATTENTION", "draft_vocabulary", "training_time_test",
]
