#!/usr/bin/env python3
"""Writes tests/broker/corpus/: what a client might send on one connection to cushare-broker.

Each file is the raw bytes of one connection (a 4-byte little-endian length, then a serialised
cushare.rpc.Request; see broker/rpc/control.proto). Files named valid-*.bin must be accepted by
decodeRequest; every other file must be rejected with a one-line error. The unit tests check
both, and the fuzzer (scripts/fuzz.sh) starts from these files.

Protobuf is encoded by hand (the few fields of control.proto), so no protobuf package is needed.
Run it again after changing the cases; its output is checked in.
"""
import os
import shutil
import struct
import sys

# Field numbers of control.proto.
VERSION, STATUS, TENANTS, PROCESSES, SET_LIMIT, RELOAD, ENV = 1, 2, 3, 4, 5, 6, 7
SL_TENANT, SL_MEMORY, SL_DEVICE, SL_RESET = 1, 2, 3, 4
MAX_REQUEST = 64 * 1024


def varint(n):
    n &= (1 << 64) - 1  # negative int32 values are sign-extended to ten bytes
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def key(field, wire_type):
    return varint(field << 3 | wire_type)


def uint(field, n):
    return key(field, 0) + varint(n)


def blob(field, data):
    if isinstance(data, str):
        data = data.encode()
    return key(field, 2) + varint(len(data)) + data


def request(body_field, body=b"", version=1):
    return (uint(VERSION, version) if version else b"") + blob(body_field, body)


def set_limit(tenant=None, memory=None, device=None, reset=False):
    body = b""
    if tenant is not None:
        body += blob(SL_TENANT, tenant)
    if memory is not None:
        body += blob(SL_MEMORY, memory)
    if device is not None:
        body += uint(SL_DEVICE, device)
    if reset:
        body += uint(SL_RESET, 1)
    return request(SET_LIMIT, body)


def frame(payload):
    return struct.pack("<I", len(payload)) + payload


STATUS_FRAME = frame(request(STATUS))

CASES = {
    # Accepted.
    "valid-status": STATUS_FRAME,
    "valid-tenants-all": frame(request(TENANTS)),
    "valid-tenants-one": frame(request(TENANTS, blob(1, "team-a"))),
    "valid-processes": frame(request(PROCESSES, blob(1, "team_b.prod"))),
    "valid-set-limit-size": frame(set_limit("team-a", "8GiB", device=-1)),
    "valid-set-limit-percent": frame(set_limit("team-a", "12.5%", device=0)),
    "valid-set-limit-reset": frame(set_limit("team-a", reset=True, device=1)),
    "valid-reload": frame(request(RELOAD)),
    "valid-env": frame(request(ENV, blob(1, "team-a"))),
    # A newer client's extra field is ignored (forward compatibility).
    "valid-unknown-field": frame(request(STATUS) + uint(100, 7) + blob(101, "future")),
    # Framing.
    "empty-connection": b"",
    "truncated-length": b"\x05\x00",
    "truncated-payload": frame(request(STATUS))[:-1],
    "length-4GiB": b"\xff\xff\xff\xff" + request(STATUS),
    "length-over-max": struct.pack("<I", MAX_REQUEST + 1) + request(STATUS),
    "trailing-byte": STATUS_FRAME + b"\x00",
    "two-requests": STATUS_FRAME + STATUS_FRAME,
    # Not a Request message.
    "garbage": frame(b"\xde\xad\xbe\xef\xff\xff\xff"),
    "truncated-varint": frame(key(VERSION, 0) + b"\x80\x80"),
    "submessage-past-end": frame(uint(VERSION, 1) + key(STATUS, 2) + varint(50) + b"\x00"),
    "version-as-string": frame(blob(VERSION, "1") + blob(STATUS, b"")),
    "deep-unknown-groups": frame(uint(VERSION, 1) + key(99, 3) * 200 + key(99, 4) * 200),
    "tenant-not-utf8": frame(request(TENANTS, blob(1, b"\xff\xfe"))),
    # Version and body.
    "empty-request": frame(b""),
    "version-missing": frame(request(STATUS, version=0)),
    "version-2": frame(request(STATUS, version=2)),
    "version-huge": frame(uint(VERSION, 2**32 - 1) + blob(STATUS, b"")),
    "body-missing": frame(uint(VERSION, 1)),
    "body-unknown": frame(request(99)),
    # Tenant names.
    "tenants-slash": frame(request(TENANTS, blob(1, "a/b"))),
    "tenants-dotdot": frame(request(TENANTS, blob(1, ".."))),
    "processes-nul": frame(request(PROCESSES, blob(1, "a\0b"))),
    "processes-space": frame(request(PROCESSES, blob(1, "team a"))),
    "env-64-chars": frame(request(ENV, blob(1, "x" * 64))),
    "env-newline": frame(request(ENV, blob(1, "team\nINJECTED=1"))),
    "env-traversal": frame(request(ENV, blob(1, "../etc/passwd"))),
    "env-no-tenant": frame(request(ENV)),
    # set_limit.
    "set-limit-no-tenant": frame(set_limit(memory="1GiB")),
    "set-limit-bad-tenant": frame(set_limit("a/b", "1GiB")),
    "set-limit-neither": frame(set_limit("team-a")),
    "set-limit-both": frame(set_limit("team-a", "1GiB", reset=True)),
    "set-limit-device-minus-2": frame(set_limit("team-a", "1GiB", device=-2)),
    "set-limit-device-int-min": frame(set_limit("team-a", "1GiB", device=-(2**31))),
    "set-limit-bad-unit": frame(set_limit("team-a", "12x")),
    "set-limit-negative": frame(set_limit("team-a", "-1GiB")),
    "set-limit-zero": frame(set_limit("team-a", "0")),
    "set-limit-overflow": frame(set_limit("team-a", "99999999999TiB")),
    "set-limit-fraction-of-byte": frame(set_limit("team-a", "1.5")),
    "set-limit-percent-zero": frame(set_limit("team-a", "0%")),
    "set-limit-percent-over": frame(set_limit("team-a", "100.001%")),
    "set-limit-percent-decimals": frame(set_limit("team-a", "12.3456%")),
    "set-limit-percent-bare": frame(set_limit("team-a", "%")),
    "set-limit-percent-negative": frame(set_limit("team-a", "-5%")),
    "set-limit-whitespace": frame(set_limit("team-a", "   ")),
    "set-limit-control-chars": frame(set_limit("team-a", "1G\niB")),
}


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    shutil.rmtree(out, ignore_errors=True)  # a renamed case must not leave its old file behind
    os.makedirs(out)
    for name, data in sorted(CASES.items()):
        with open(os.path.join(out, name + ".bin"), "wb") as f:
            f.write(data)
    print(f"wrote {len(CASES)} files to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
