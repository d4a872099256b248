from fusion.wire import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    STATE_KIND_PARAMETERS: _ClassVar[StateKind]
    STATE_KIND_GRADIENTS: _ClassVar[StateKind]
    STATE_KIND_RESIDUALS: _ClassVar[StateKind]

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SCHEDULE_GPIPE: _ClassVar[Schedule]
    SCHEDULE_1F1B: _ClassVar[Schedule]
STATE_KIND_UNSPECIFIED: StateKind
STATE_KIND_PARAMETERS: StateKind
STATE_KIND_GRADIENTS: StateKind
STATE_KIND_RESIDUALS: StateKind
SCHEDULE_UNSPECIFIED: Schedule
SCHEDULE_GPIPE: Schedule
SCHEDULE_1F1B: Schedule

class ModelSpec(_message.Message):
    __slots__ = ("name", "preset", "kwargs_json", "leaf_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    LEAF_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    preset: str
    kwargs_json: str
    leaf_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., preset: _Optional[str] = ..., kwargs_json: _Optional[str] = ..., leaf_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class StageInput(_message.Message):
    __slots__ = ("name", "src_stage_idx")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    name: str
    src_stage_idx: int
    def __init__(self, name: _Optional[str] = ..., src_stage_idx: _Optional[int] = ...) -> None: ...

class StageOutput(_message.Message):
    __slots__ = ("name", "dst_stage_idx")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DST_STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    name: str
    dst_stage_idx: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dst_stage_idx: _Optional[_Iterable[int]] = ...) -> None: ...

class ValueSpec(_message.Message):
    __slots__ = ("name", "kind", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class CutCodec(_message.Message):
    __slots__ = ("src_stage_idx", "dst_stage_idx", "codec", "keep_ratio", "activations", "gradients", "bits", "gradient_codec", "gradient_keep_ratio", "gradient_bits")
    SRC_STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    DST_STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BITS_FIELD_NUMBER: _ClassVar[int]
    src_stage_idx: int
    dst_stage_idx: int
    codec: _tensor_pb2.Codec
    keep_ratio: float
    activations: bool
    gradients: bool
    bits: int
    gradient_codec: _tensor_pb2.Codec
    gradient_keep_ratio: float
    gradient_bits: int
    def __init__(self, src_stage_idx: _Optional[int] = ..., dst_stage_idx: _Optional[int] = ..., codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., keep_ratio: _Optional[float] = ..., activations: _Optional[bool] = ..., gradients: _Optional[bool] = ..., bits: _Optional[int] = ..., gradient_codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., gradient_keep_ratio: _Optional[float] = ..., gradient_bits: _Optional[int] = ...) -> None: ...

class LoadStageRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "model", "example_inputs", "nodes", "inputs", "outputs", "values", "is_loss_stage", "loss", "stage_addresses", "depth", "train_json", "graph_fingerprint", "device", "chunk_bytes", "micro_batch_weights", "auth", "cut_codecs", "tied", "link_bytes_per_s", "planned_peak_memory_bytes")
    class StageAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class LinkBytesPerSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    IS_LOSS_STAGE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TRAIN_JSON_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    CUT_CODECS_FIELD_NUMBER: _ClassVar[int]
    TIED_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PLANNED_PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    model: ModelSpec
    example_inputs: _containers.RepeatedCompositeFieldContainer[ValueSpec]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    inputs: _containers.RepeatedCompositeFieldContainer[StageInput]
    outputs: _containers.RepeatedCompositeFieldContainer[StageOutput]
    values: _containers.RepeatedCompositeFieldContainer[ValueSpec]
    is_loss_stage: bool
    loss: str
    stage_addresses: _containers.ScalarMap[int, str]
    depth: int
    train_json: str
    graph_fingerprint: str
    device: str
    chunk_bytes: int
    micro_batch_weights: _containers.RepeatedScalarFieldContainer[float]
    auth: str
    cut_codecs: _containers.RepeatedCompositeFieldContainer[CutCodec]
    tied: _containers.RepeatedCompositeFieldContainer[TiedParameter]
    link_bytes_per_s: _containers.ScalarMap[int, float]
    planned_peak_memory_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., example_inputs: _Optional[_Iterable[_Union[ValueSpec, _Mapping]]] = ..., nodes: _Optional[_Iterable[str]] = ..., inputs: _Optional[_Iterable[_Union[StageInput, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[StageOutput, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[ValueSpec, _Mapping]]] = ..., is_loss_stage: _Optional[bool] = ..., loss: _Optional[str] = ..., stage_addresses: _Optional[_Mapping[int, str]] = ..., depth: _Optional[int] = ..., train_json: _Optional[str] = ..., graph_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., micro_batch_weights: _Optional[_Iterable[float]] = ..., auth: _Optional[str] = ..., cut_codecs: _Optional[_Iterable[_Union[CutCodec, _Mapping]]] = ..., tied: _Optional[_Iterable[_Union[TiedParameter, _Mapping]]] = ..., link_bytes_per_s: _Optional[_Mapping[int, float]] = ..., planned_peak_memory_bytes: _Optional[int] = ...) -> None: ...

class TiedParameter(_message.Message):
    __slots__ = ("name", "canonical", "holder_stage_idx")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_FIELD_NUMBER: _ClassVar[int]
    HOLDER_STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    name: str
    canonical: str
    holder_stage_idx: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., canonical: _Optional[str] = ..., holder_stage_idx: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadStageResponse(_message.Message):
    __slots__ = ("parameter_names", "buffer_names", "parameter_bytes")
    PARAMETER_NAMES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_NAMES_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    parameter_names: _containers.RepeatedScalarFieldContainer[str]
    buffer_names: _containers.RepeatedScalarFieldContainer[str]
    parameter_bytes: int
    def __init__(self, parameter_names: _Optional[_Iterable[str]] = ..., buffer_names: _Optional[_Iterable[str]] = ..., parameter_bytes: _Optional[int] = ...) -> None: ...

class SetStateResponse(_message.Message):
    __slots__ = ("num_tensors",)
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    def __init__(self, num_tensors: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "kind", "names", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    kind: StateKind
    names: _containers.RepeatedScalarFieldContainer[str]
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., kind: _Optional[_Union[StateKind, str]] = ..., names: _Optional[_Iterable[str]] = ..., auth: _Optional[str] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("received_bytes", "data_port")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    data_port: int
    def __init__(self, received_bytes: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...

class RunStepRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "step", "num_micro_batches", "schedule", "auth", "measure_memory", "cut_codecs", "finish")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    MEASURE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUT_CODECS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    step: int
    num_micro_batches: int
    schedule: Schedule
    auth: str
    measure_memory: bool
    cut_codecs: _containers.RepeatedCompositeFieldContainer[CutCodec]
    finish: StepFinish
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., auth: _Optional[str] = ..., measure_memory: _Optional[bool] = ..., cut_codecs: _Optional[_Iterable[_Union[CutCodec, _Mapping]]] = ..., finish: _Optional[_Union[StepFinish, _Mapping]] = ...) -> None: ...

class StepFinish(_message.Message):
    __slots__ = ("optimizer_step", "snapshot", "replicate_to", "replicate_bytes_per_s")
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_TO_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: bool
    snapshot: bool
    replicate_to: str
    replicate_bytes_per_s: float
    def __init__(self, optimizer_step: _Optional[bool] = ..., snapshot: _Optional[bool] = ..., replicate_to: _Optional[str] = ..., replicate_bytes_per_s: _Optional[float] = ...) -> None: ...

class RunStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitStepRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "step", "timeout_s", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    step: int
    timeout_s: float
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., timeout_s: _Optional[float] = ..., auth: _Optional[str] = ...) -> None: ...

class WaitStepResponse(_message.Message):
    __slots__ = ("done", "loss", "has_loss", "compute_s", "sent_bytes", "sent_s", "peak_memory_bytes", "dense_bytes", "compression_error")
    class SentBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class SentSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class DenseBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class CompressionErrorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DONE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DENSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_ERROR_FIELD_NUMBER: _ClassVar[int]
    done: bool
    loss: float
    has_loss: bool
    compute_s: float
    sent_bytes: _containers.ScalarMap[int, int]
    sent_s: _containers.ScalarMap[int, float]
    peak_memory_bytes: int
    dense_bytes: _containers.ScalarMap[int, int]
    compression_error: _containers.ScalarMap[int, float]
    def __init__(self, done: _Optional[bool] = ..., loss: _Optional[float] = ..., has_loss: _Optional[bool] = ..., compute_s: _Optional[float] = ..., sent_bytes: _Optional[_Mapping[int, int]] = ..., sent_s: _Optional[_Mapping[int, float]] = ..., peak_memory_bytes: _Optional[int] = ..., dense_bytes: _Optional[_Mapping[int, int]] = ..., compression_error: _Optional[_Mapping[int, float]] = ...) -> None: ...

class ApplyStepRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "step", "optimizer_step", "auth", "snapshot", "replicate_to", "replicate_bytes_per_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_TO_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    step: int
    optimizer_step: bool
    auth: str
    snapshot: bool
    replicate_to: str
    replicate_bytes_per_s: float
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., optimizer_step: _Optional[bool] = ..., auth: _Optional[str] = ..., snapshot: _Optional[bool] = ..., replicate_to: _Optional[str] = ..., replicate_bytes_per_s: _Optional[float] = ...) -> None: ...

class ApplyStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncTiedRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "step", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    step: int
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., auth: _Optional[str] = ...) -> None: ...

class SyncTiedResponse(_message.Message):
    __slots__ = ("sent_bytes", "seconds")
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sent_bytes: int
    seconds: float
    def __init__(self, sent_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("job_id", "reason", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ..., auth: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadJobRequest(_message.Message):
    __slots__ = ("job_id", "auth", "keep_snapshots")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    KEEP_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    auth: str
    keep_snapshots: bool
    def __init__(self, job_id: _Optional[str] = ..., auth: _Optional[str] = ..., keep_snapshots: _Optional[bool] = ...) -> None: ...

class UnloadJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("received_bytes", "receive_s")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    receive_s: float
    def __init__(self, received_bytes: _Optional[int] = ..., receive_s: _Optional[float] = ...) -> None: ...

class ProfileModelRequest(_message.Message):
    __slots__ = ("model", "example_inputs", "device", "train_json", "repeats", "auth")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_JSON_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    example_inputs: _containers.RepeatedCompositeFieldContainer[ValueSpec]
    device: str
    train_json: str
    repeats: int
    auth: str
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., example_inputs: _Optional[_Iterable[_Union[ValueSpec, _Mapping]]] = ..., device: _Optional[str] = ..., train_json: _Optional[str] = ..., repeats: _Optional[int] = ..., auth: _Optional[str] = ...) -> None: ...

class ProfileModelResponse(_message.Message):
    __slots__ = ("profile_json", "matmul_flops", "optimizer_s_per_byte", "graph_fingerprint", "device_name")
    PROFILE_JSON_FIELD_NUMBER: _ClassVar[int]
    MATMUL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_S_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    profile_json: str
    matmul_flops: float
    optimizer_s_per_byte: float
    graph_fingerprint: str
    device_name: str
    def __init__(self, profile_json: _Optional[str] = ..., matmul_flops: _Optional[float] = ..., optimizer_s_per_byte: _Optional[float] = ..., graph_fingerprint: _Optional[str] = ..., device_name: _Optional[str] = ...) -> None: ...

class ProbeLinksRequest(_message.Message):
    __slots__ = ("addresses", "sizes_bytes", "repeats", "auth")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SIZES_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    sizes_bytes: _containers.RepeatedScalarFieldContainer[int]
    repeats: int
    auth: str
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., sizes_bytes: _Optional[_Iterable[int]] = ..., repeats: _Optional[int] = ..., auth: _Optional[str] = ...) -> None: ...

class LinkFit(_message.Message):
    __slots__ = ("address", "latency_s", "bandwidth_bytes_per_s", "error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    latency_s: float
    bandwidth_bytes_per_s: float
    error: str
    def __init__(self, address: _Optional[str] = ..., latency_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ProbeLinksResponse(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkFit]
    def __init__(self, links: _Optional[_Iterable[_Union[LinkFit, _Mapping]]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("worker_name", "jobs", "data_port")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    jobs: _containers.RepeatedScalarFieldContainer[str]
    data_port: int
    def __init__(self, worker_name: _Optional[str] = ..., jobs: _Optional[_Iterable[str]] = ..., data_port: _Optional[int] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("job_id", "stage_idx", "stage_key", "step", "size_bytes", "sha256", "replica", "step_loss")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STAGE_KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STEP_LOSS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    stage_key: str
    step: int
    size_bytes: int
    sha256: str
    replica: bool
    step_loss: float
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., stage_key: _Optional[str] = ..., step: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., replica: _Optional[bool] = ..., step_loss: _Optional[float] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("info", "data", "auth")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    info: SnapshotInfo
    data: bytes
    auth: str
    def __init__(self, info: _Optional[_Union[SnapshotInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., auth: _Optional[str] = ...) -> None: ...

class TakeSnapshotRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "step", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    step: int
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., auth: _Optional[str] = ...) -> None: ...

class TakeSnapshotResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: SnapshotInfo
    def __init__(self, info: _Optional[_Union[SnapshotInfo, _Mapping]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("job_id", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., auth: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ("job_id", "stage_key", "step", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_key: str
    step: int
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_key: _Optional[str] = ..., step: _Optional[int] = ..., auth: _Optional[str] = ...) -> None: ...

class PutSnapshotResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: SnapshotInfo
    def __init__(self, info: _Optional[_Union[SnapshotInfo, _Mapping]] = ...) -> None: ...

class RestoreStageRequest(_message.Message):
    __slots__ = ("job_id", "stage_idx", "step", "source_address", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    step: int
    source_address: str
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., source_address: _Optional[str] = ..., auth: _Optional[str] = ...) -> None: ...

class RestoreStageResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: SnapshotInfo
    def __init__(self, info: _Optional[_Union[SnapshotInfo, _Mapping]] = ...) -> None: ...

class AdmitJobRequest(_message.Message):
    __slots__ = ("job_id", "auth", "model", "example_inputs", "train_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    auth: str
    model: ModelSpec
    example_inputs: _containers.RepeatedCompositeFieldContainer[ValueSpec]
    train_json: str
    def __init__(self, job_id: _Optional[str] = ..., auth: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., example_inputs: _Optional[_Iterable[_Union[ValueSpec, _Mapping]]] = ..., train_json: _Optional[str] = ...) -> None: ...

class AdmitJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
