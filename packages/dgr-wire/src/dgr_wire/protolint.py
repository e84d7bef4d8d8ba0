"""Mechanical rules for the dgr.v1 schema, read from the compiled descriptor (not the text)."""

from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf.descriptor import Descriptor, FileDescriptor

SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")
PASCAL = re.compile(r"^[A-Z][A-Za-z0-9]*$")


def file_descriptor() -> FileDescriptor:
    from dgr.v1 import shard_pb2

    descriptor: FileDescriptor = shard_pb2.DESCRIPTOR
    return descriptor


def _messages() -> list[Descriptor]:
    return list(file_descriptor().message_types_by_name.values())


def lint_problems() -> list[str]:
    fd = file_descriptor()
    problems = []
    if fd.package != "dgr.v1":
        problems.append(f"package is {fd.package!r}, expected a versioned 'dgr.v1'")
    for enum in fd.enum_types_by_name.values():
        zero = enum.values_by_number.get(0)
        if zero is None or not zero.name.endswith("_UNSPECIFIED"):
            problems.append(f"enum {enum.name}: value 0 must be *_UNSPECIFIED")
    for message in _messages():
        if not PASCAL.match(message.name):
            problems.append(f"message {message.name} is not PascalCase")
        for f in message.fields:
            if not SNAKE.match(f.name):
                problems.append(f"field {message.name}.{f.name} is not snake_case")
    for service in fd.services_by_name.values():
        for method in service.methods:
            if not PASCAL.match(method.name):
                problems.append(f"rpc {service.name}.{method.name} is not PascalCase")
    return problems


def _type_name(field: Any) -> str:
    target = field.message_type or field.enum_type
    return str(target.full_name) if target is not None else ""


def snapshot() -> dict[str, Any]:
    """message -> field -> [number, type, repeated, message/enum type name];
    service -> rpc -> [input, output, client streaming, server streaming]."""
    fd = file_descriptor()
    return {
        "messages": {
            m.name: {f.name: [f.number, f.type, f.is_repeated, _type_name(f)] for f in m.fields}
            for m in _messages()
        },
        "services": {
            s.name: {
                m.name: [
                    m.input_type.name,
                    m.output_type.name,
                    m.client_streaming,
                    m.server_streaming,
                ]
                for m in s.methods
            }
            for s in fd.services_by_name.values()
        },
    }


def _reserved(message: str) -> tuple[set[int], set[str]]:
    """The field numbers and names `message` reserves (`reserved 3; reserved "x";`)."""
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    file_descriptor().message_types_by_name[message].CopyToProto(proto)
    numbers = {n for r in proto.reserved_range for n in range(r.start, r.end)}
    return numbers, set(proto.reserved_name)


def compatibility_problems(lock: dict[str, Any]) -> list[str]:
    """Everything in the lock must still exist unchanged; additions are fine. What the lock lists
    as retired (`dgr-proto retire`) is gone for good: a retired message or rpc may not come back
    under its name, and a retired field's number and name stay reserved in its message."""
    now = snapshot()
    retired = lock.get("retired", {"messages": {}, "fields": {}, "rpcs": {}})
    problems = []
    for message, fields in lock["messages"].items():
        current = now["messages"].get(message)
        if current is None:
            problems.append(f"message {message} was removed")
            continue
        numbers = {v[0]: k for k, v in current.items()}
        for name, spec in fields.items():
            if current.get(name) != spec:
                reused = numbers.get(spec[0])
                detail = f" (number {spec[0]} now names {reused})" if reused else ""
                problems.append(f"field {message}.{name} changed or was removed{detail}")
    for service, methods in lock["services"].items():
        for name, spec in methods.items():
            if now["services"].get(service, {}).get(name) != spec:
                problems.append(f"rpc {service}.{name} changed or was removed")
    for message in retired["messages"]:
        if message in now["messages"]:
            problems.append(f"message {message} is retired: it may not come back")
    for service, methods in retired["rpcs"].items():
        for name in methods:
            if name in now["services"].get(service, {}):
                problems.append(f"rpc {service}.{name} is retired: it may not come back")
    for message, fields in retired["fields"].items():
        if message not in now["messages"]:
            continue
        taken, reserved_names = _reserved(message)
        for name, spec in fields.items():
            if spec[0] not in taken or name not in reserved_names:
                problems.append(
                    f"field {message}.{name} is retired: `reserved {spec[0]}; reserved "
                    f'"{name}";` must stay in its message'
                )
    return problems


def retire(lock: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    """The lock with `name` (a message, Message.field or Service.Rpc) moved from what must stay
    to what is retired; KeyError when the lock does not hold it."""
    out: dict[str, Any] = json.loads(json.dumps(lock))
    retired = out.setdefault("retired", {"messages": {}, "fields": {}, "rpcs": {}})
    if kind == "message":
        retired["messages"][name] = out["messages"].pop(name)
    elif kind == "field":
        message, field = name.split(".", 1)
        spec = out["messages"][message].pop(field)
        retired["fields"].setdefault(message, {})[field] = spec
    elif kind == "rpc":
        service, rpc = name.split(".", 1)
        spec = out["services"][service].pop(rpc)
        retired["rpcs"].setdefault(service, {})[rpc] = spec
    else:
        raise ValueError(f"retire: a message, field or rpc, not {kind!r}")
    return out
