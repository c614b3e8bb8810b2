"""A minimal proxy-wasm module, assembled byte by byte, for Envoy --mode validate.

Why this exists: Envoy's validate mode really loads the wasm module named in
a wasm filter (a missing or invalid file fails validation). The deploy tests
prefer the real `kvroute.wasm` (then the real filter also parses the plugin
JSON in on_configure); when it has not been built yet, this stub lets the rest
of each Envoy config (listeners, routes, clusters, override_host policy,
buffer limits, timeouts) still be validated by the real Envoy.

The stub exports what proxy-wasm-cpp-host needs to start a plugin: `memory`,
the ABI marker `proxy_abi_version_0_2_1`, an allocator, and `proxy_on_*`
callbacks that accept any configuration.
"""

from __future__ import annotations


def _leb(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _vec(items: list[bytes]) -> bytes:
    return _leb(len(items)) + b"".join(items)


def _section(sid: int, body: bytes) -> bytes:
    return bytes([sid]) + _leb(len(body)) + body


def _name(s: str) -> bytes:
    return _leb(len(s)) + s.encode()


I32 = 0x7F
# Function types: () -> (), (i32) -> i32, (i32, i32) -> (), (i32, i32) -> i32
TYPES = [([], []), ([I32], [I32]), ([I32, I32], []), ([I32, I32], [I32])]
# (export name, type index, body instructions without `end`)
I32_CONST_1 = b"\x41\x01"
FUNCS = [
    ("proxy_abi_version_0_2_1", 0, b""),
    ("_initialize", 0, b""),
    ("proxy_on_memory_allocate", 1, b"\x41" + _leb(1024)),  # bump-free: any size -> 1024
    ("proxy_on_context_create", 2, b""),
    ("proxy_on_vm_start", 3, I32_CONST_1),
    ("proxy_on_configure", 3, I32_CONST_1),
]


def stub_wasm() -> bytes:
    types = _vec([b"\x60" + _vec([bytes([p]) for p in ps]) + _vec([bytes([r]) for r in rs])
                  for ps, rs in TYPES])
    funcs = _vec([_leb(t) for _, t, _ in FUNCS])
    memory = _vec([b"\x00" + _leb(2)])  # one memory, min 2 pages, no max
    exports = _vec([_name("memory") + b"\x02" + _leb(0)]
                   + [_name(n) + b"\x00" + _leb(i) for i, (n, _, _) in enumerate(FUNCS)])
    bodies = []
    for _, _, code in FUNCS:
        body = b"\x00" + code + b"\x0b"  # no locals, instructions, end
        bodies.append(_leb(len(body)) + body)
    return (b"\x00asm\x01\x00\x00\x00"
            + _section(1, types) + _section(3, funcs) + _section(5, memory)
            + _section(7, exports) + _section(10, _vec(bodies)))


if __name__ == "__main__":
    import sys
    sys.stdout.buffer.write(stub_wasm())
