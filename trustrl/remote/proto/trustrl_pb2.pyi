from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    ACCEPTED: _ClassVar[Outcome]
    RETRY: _ClassVar[Outcome]
    REFUSED: _ClassVar[Outcome]
    STALE: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
ACCEPTED: Outcome
RETRY: Outcome
REFUSED: Outcome
STALE: Outcome

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Weight(_message.Message):
    __slots__ = ("group", "name", "array")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    group: int
    name: str
    array: Array
    def __init__(self, group: _Optional[int] = ..., name: _Optional[str] = ..., array: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("version", "description_json", "weights", "onnx")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ONNX_FIELD_NUMBER: _ClassVar[int]
    version: int
    description_json: str
    weights: _containers.RepeatedCompositeFieldContainer[Weight]
    onnx: bytes
    def __init__(self, version: _Optional[int] = ..., description_json: _Optional[str] = ..., weights: _Optional[_Iterable[_Union[Weight, _Mapping]]] = ..., onnx: _Optional[bytes] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("have", "wait_seconds", "onnx")
    HAVE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ONNX_FIELD_NUMBER: _ClassVar[int]
    have: int
    wait_seconds: float
    onnx: bool
    def __init__(self, have: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., onnx: _Optional[bool] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("version", "finished", "policy")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    version: int
    finished: bool
    policy: Policy
    def __init__(self, version: _Optional[int] = ..., finished: _Optional[bool] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("agent", "source", "seq", "version", "ending", "obs", "actions", "rewards", "action_mask", "logprob", "values", "obs_mean", "obs_m2", "obs_count", "episode_return", "episode_length", "obs_entries", "states")
    class ObsEntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...
    AGENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDING_FIELD_NUMBER: _ClassVar[int]
    OBS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    OBS_MEAN_FIELD_NUMBER: _ClassVar[int]
    OBS_M2_FIELD_NUMBER: _ClassVar[int]
    OBS_COUNT_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_FIELD_NUMBER: _ClassVar[int]
    EPISODE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OBS_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    agent: str
    source: str
    seq: int
    version: int
    ending: str
    obs: Array
    actions: Array
    rewards: Array
    action_mask: Array
    logprob: Array
    values: Array
    obs_mean: Array
    obs_m2: Array
    obs_count: float
    episode_return: float
    episode_length: int
    obs_entries: _containers.MessageMap[str, Array]
    states: Array
    def __init__(self, agent: _Optional[str] = ..., source: _Optional[str] = ..., seq: _Optional[int] = ..., version: _Optional[int] = ..., ending: _Optional[str] = ..., obs: _Optional[_Union[Array, _Mapping]] = ..., actions: _Optional[_Union[Array, _Mapping]] = ..., rewards: _Optional[_Union[Array, _Mapping]] = ..., action_mask: _Optional[_Union[Array, _Mapping]] = ..., logprob: _Optional[_Union[Array, _Mapping]] = ..., values: _Optional[_Union[Array, _Mapping]] = ..., obs_mean: _Optional[_Union[Array, _Mapping]] = ..., obs_m2: _Optional[_Union[Array, _Mapping]] = ..., obs_count: _Optional[float] = ..., episode_return: _Optional[float] = ..., episode_length: _Optional[int] = ..., obs_entries: _Optional[_Mapping[str, Array]] = ..., states: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class ChunkResult(_message.Message):
    __slots__ = ("outcome", "error", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    error: str
    reason: str
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., error: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("results", "pressure", "slow_down_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    SLOW_DOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ChunkResult]
    pressure: str
    slow_down_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[ChunkResult, _Mapping]]] = ..., pressure: _Optional[str] = ..., slow_down_seconds: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "finished", "agent", "learner_json", "counts", "refused")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LEARNER_JSON_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    version: int
    finished: bool
    agent: str
    learner_json: str
    counts: _containers.ScalarMap[str, int]
    refused: _containers.ScalarMap[str, int]
    def __init__(self, version: _Optional[int] = ..., finished: _Optional[bool] = ..., agent: _Optional[str] = ..., learner_json: _Optional[str] = ..., counts: _Optional[_Mapping[str, int]] = ..., refused: _Optional[_Mapping[str, int]] = ...) -> None: ...
