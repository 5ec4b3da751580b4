"""Typed, validated schemas: the contract between every part of Sailor.

Pure data: no I/O, no torch. Every model is frozen and forbids unknown fields.
"""

from sailor.schemas._base import SCHEMA_VERSION, Frozen, WireMessage
from sailor.schemas.calibration import Calibration, ConstantRange, GPUCalibration, GPUPrior
from sailor.schemas.checkpoint import CheckpointManifest, ShardEntry, TensorEntry
from sailor.schemas.commands import (
    Abort,
    Checkpoint,
    Command,
    CommandAdapter,
    Launch,
    Prepare,
    Stop,
)
from sailor.schemas.data_identity import DataIdentity
from sailor.schemas.dataset import CorpusSource, DatasetManifest, DocumentRange, TokenizerInfo
from sailor.schemas.deployment import Deployment, DeploymentStructure
from sailor.schemas.estimate import (
    CornerFigures,
    Estimate,
    EstimateInterval,
    Interval,
    MemoryBreakdown,
    StageTime,
    TimeBreakdown,
)
from sailor.schemas.events import (
    Event,
    EventAdapter,
    Heartbeat,
    NodeJoined,
    NodeLeft,
    PreemptionNotice,
    WorkerFailed,
)
from sailor.schemas.hardware import GPUSpec, NodeSpec, Pool, PoolEntry, Zone
from sailor.schemas.model import LayerKind, ModelSpec, Precision
from sailor.schemas.network import BandwidthCurve, Endpoint, Link, NetworkProfile
from sailor.schemas.plan import (
    Pipeline,
    Plan,
    PlanPrediction,
    ReplicaGroup,
    Segment,
    Stage,
    layer_segments,
)
from sailor.schemas.prices import EgressPrice, GPUPrice, PriceTable
from sailor.schemas.profile import (
    DeviceOverhead,
    LayerMemory,
    LayerProfile,
    LayerSize,
    ProfileDB,
)
from sailor.schemas.training import TrainingConfig, parse_training_config

__all__ = [
    "SCHEMA_VERSION",
    "Abort",
    "BandwidthCurve",
    "Calibration",
    "Checkpoint",
    "CheckpointManifest",
    "Command",
    "CommandAdapter",
    "ConstantRange",
    "CornerFigures",
    "CorpusSource",
    "DataIdentity",
    "DatasetManifest",
    "Deployment",
    "DeploymentStructure",
    "DeviceOverhead",
    "DocumentRange",
    "EgressPrice",
    "Endpoint",
    "Estimate",
    "EstimateInterval",
    "Event",
    "EventAdapter",
    "Frozen",
    "GPUCalibration",
    "GPUPrice",
    "GPUPrior",
    "GPUSpec",
    "Heartbeat",
    "Interval",
    "Launch",
    "LayerKind",
    "LayerMemory",
    "LayerProfile",
    "LayerSize",
    "Link",
    "MemoryBreakdown",
    "ModelSpec",
    "NetworkProfile",
    "NodeJoined",
    "NodeLeft",
    "NodeSpec",
    "Pipeline",
    "Plan",
    "PlanPrediction",
    "Pool",
    "PoolEntry",
    "Precision",
    "PreemptionNotice",
    "Prepare",
    "PriceTable",
    "ProfileDB",
    "ReplicaGroup",
    "Segment",
    "ShardEntry",
    "Stage",
    "StageTime",
    "Stop",
    "TensorEntry",
    "TimeBreakdown",
    "TokenizerInfo",
    "TrainingConfig",
    "WireMessage",
    "WorkerFailed",
    "Zone",
    "layer_segments",
    "parse_training_config",
]
