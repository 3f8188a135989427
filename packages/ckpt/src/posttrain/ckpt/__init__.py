"""Crash-safe, reshardable DCP checkpoints and Hugging Face export for posttrain.

``CheckpointManager`` stages, commits (fsync, atomic rename, then the tracker) and retains step directories
(``retain``: the newest N, deleted only after the new one is in place, also used by engines saving directly);
``save_role``/``load_role`` write and read one model's DCP shards (keyed by HF names), extra state and HF
files; ``AsyncWriter`` runs the writes of an async save in the background (``prepare_role`` allocates its host
buffers ahead of the first save); ``export_hf`` turns a role into an HF model; ``verify_role``/``verify_step``
check a checkpoint's files against the checksums its save recorded and ``find_intact`` finds the newest step
that passes.
"""

from .extra import capture_rng, restore_rng
from .hf import export_hf, load_full_model_state
from .layout import TRACKER, is_complete
from .manager import CheckpointManager, find_intact, find_latest, load_trainer_state
from .retention import retain, retain_role_saves, step_dirs
from .role import RoleInfo, RoleState, load_role, prepare_role, read_role_manifest, save_role
from .verify import CheckpointCorruptError, verify_role, verify_step
from .writer import AsyncWriter, CheckpointWriteError

__all__ = [
    "TRACKER",
    "AsyncWriter",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointWriteError",
    "RoleInfo",
    "RoleState",
    "capture_rng",
    "export_hf",
    "find_intact",
    "find_latest",
    "is_complete",
    "load_full_model_state",
    "load_role",
    "load_trainer_state",
    "prepare_role",
    "read_role_manifest",
    "restore_rng",
    "retain",
    "retain_role_saves",
    "save_role",
    "step_dirs",
    "verify_role",
    "verify_step",
]
