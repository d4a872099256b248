from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerResources(_message.Message):
    __slots__ = ("num_cores", "memory_bytes", "device", "device_name", "device_memory_bytes", "matmul_flops", "torch_version", "fusion_version", "machine", "allows_code")
    NUM_CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MATMUL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    FUSION_VERSION_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    ALLOWS_CODE_FIELD_NUMBER: _ClassVar[int]
    num_cores: int
    memory_bytes: int
    device: str
    device_name: str
    device_memory_bytes: int
    matmul_flops: float
    torch_version: str
    fusion_version: str
    machine: str
    allows_code: bool
    def __init__(self, num_cores: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., matmul_flops: _Optional[float] = ..., torch_version: _Optional[str] = ..., fusion_version: _Optional[str] = ..., machine: _Optional[str] = ..., allows_code: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "address", "resources")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    resources: WorkerResources
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., resources: _Optional[_Union[WorkerResources, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "session", "heartbeat_interval_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    heartbeat_interval_s: float
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_json",)
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    def __init__(self, spec_json: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status_json: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class GetLogsRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class GetLogsResponse(_message.Message):
    __slots__ = ("lines", "last_seq")
    LINES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedScalarFieldContainer[str]
    last_seq: int
    def __init__(self, lines: _Optional[_Iterable[str]] = ..., last_seq: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "name", "address", "state", "resources", "last_heartbeat_age_s", "job_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    address: str
    state: str
    resources: WorkerResources
    last_heartbeat_age_s: float
    job_id: str
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., resources: _Optional[_Union[WorkerResources, _Mapping]] = ..., last_heartbeat_age_s: _Optional[float] = ..., job_id: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class ProfileWorkersRequest(_message.Message):
    __slots__ = ("spec_json", "check", "steps", "max_workers", "device")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    check: bool
    steps: int
    max_workers: int
    device: str
    def __init__(self, spec_json: _Optional[str] = ..., check: _Optional[bool] = ..., steps: _Optional[int] = ..., max_workers: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class ProfileWorkersResponse(_message.Message):
    __slots__ = ("result_json",)
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    result_json: str
    def __init__(self, result_json: _Optional[str] = ...) -> None: ...

class GetProfileRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class NodeProfile(_message.Message):
    __slots__ = ("name", "forward_s", "backward_s", "saved_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    forward_s: float
    backward_s: float
    saved_bytes: float
    def __init__(self, name: _Optional[str] = ..., forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., saved_bytes: _Optional[float] = ...) -> None: ...

class GetProfileResponse(_message.Message):
    __slots__ = ("nodes", "compute_factor", "matmul_flops", "optimizer_s_per_byte", "device_name", "overhead_step_s", "overhead_micro_batch_s", "calibrated")
    NODES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MATMUL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_S_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_STEP_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MICRO_BATCH_S_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeProfile]
    compute_factor: float
    matmul_flops: float
    optimizer_s_per_byte: float
    device_name: str
    overhead_step_s: float
    overhead_micro_batch_s: float
    calibrated: bool
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeProfile, _Mapping]]] = ..., compute_factor: _Optional[float] = ..., matmul_flops: _Optional[float] = ..., optimizer_s_per_byte: _Optional[float] = ..., device_name: _Optional[str] = ..., overhead_step_s: _Optional[float] = ..., overhead_micro_batch_s: _Optional[float] = ..., calibrated: _Optional[bool] = ...) -> None: ...

class FetchOutputsRequest(_message.Message):
    __slots__ = ("job_id", "checkpoint")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    checkpoint: bool
    def __init__(self, job_id: _Optional[str] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class OutputFileStart(_message.Message):
    __slots__ = ("path", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class OutputFileEnd(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class FetchOutputsResponse(_message.Message):
    __slots__ = ("start", "data", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: OutputFileStart
    data: bytes
    end: OutputFileEnd
    def __init__(self, start: _Optional[_Union[OutputFileStart, _Mapping]] = ..., data: _Optional[bytes] = ..., end: _Optional[_Union[OutputFileEnd, _Mapping]] = ...) -> None: ...
