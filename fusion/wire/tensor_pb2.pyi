from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_QUANT: _ClassVar[Codec]
    CODEC_TOPK_QUANT: _ClassVar[Codec]

class TransferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_KIND_UNSPECIFIED: _ClassVar[TransferKind]
    TRANSFER_KIND_ACTIVATION: _ClassVar[TransferKind]
    TRANSFER_KIND_GRADIENT: _ClassVar[TransferKind]
    TRANSFER_KIND_TARGET: _ClassVar[TransferKind]
    TRANSFER_KIND_PARAMETER: _ClassVar[TransferKind]
    TRANSFER_KIND_PARAMETER_GRADIENT: _ClassVar[TransferKind]
    TRANSFER_KIND_PROBE: _ClassVar[TransferKind]
    TRANSFER_KIND_TIED_GRADIENT: _ClassVar[TransferKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT16: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_ZSTD: Codec
CODEC_FP16: Codec
CODEC_TOPK: Codec
CODEC_QUANT: Codec
CODEC_TOPK_QUANT: Codec
TRANSFER_KIND_UNSPECIFIED: TransferKind
TRANSFER_KIND_ACTIVATION: TransferKind
TRANSFER_KIND_GRADIENT: TransferKind
TRANSFER_KIND_TARGET: TransferKind
TRANSFER_KIND_PARAMETER: TransferKind
TRANSFER_KIND_PARAMETER_GRADIENT: TransferKind
TRANSFER_KIND_PROBE: TransferKind
TRANSFER_KIND_TIED_GRADIENT: TransferKind

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "size_bytes", "codec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: int
    codec: Codec
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ...) -> None: ...

class IntList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class ScalarValue(_message.Message):
    __slots__ = ("name", "int_value", "float_value", "bool_value", "int_list", "dtype_name", "device_type", "none_value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_LIST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    NONE_VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    int_value: int
    float_value: float
    bool_value: bool
    int_list: IntList
    dtype_name: str
    device_type: str
    none_value: bool
    def __init__(self, name: _Optional[str] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., bool_value: _Optional[bool] = ..., int_list: _Optional[_Union[IntList, _Mapping]] = ..., dtype_name: _Optional[str] = ..., device_type: _Optional[str] = ..., none_value: _Optional[bool] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("job_id", "stage_idx", "src_stage_idx", "step", "micro_batch_idx", "kind", "tensors", "values", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    SRC_STAGE_IDX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_IDX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage_idx: int
    src_stage_idx: int
    step: int
    micro_batch_idx: int
    kind: TransferKind
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    values: _containers.RepeatedCompositeFieldContainer[ScalarValue]
    auth: str
    def __init__(self, job_id: _Optional[str] = ..., stage_idx: _Optional[int] = ..., src_stage_idx: _Optional[int] = ..., step: _Optional[int] = ..., micro_batch_idx: _Optional[int] = ..., kind: _Optional[_Union[TransferKind, str]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[ScalarValue, _Mapping]]] = ..., auth: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
