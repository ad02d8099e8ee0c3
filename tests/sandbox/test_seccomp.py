"""The seccomp filter's program, run here by a small classic-BPF
interpreter against what its rules declare: every system call number of
the table's architecture (and beyond it), the other ABIs, and each checked
call's arguments. The kernel's own verdicts are tests/support/hostile.py's."""

from __future__ import annotations

import itertools
import struct

import pytest

from execpool.sandbox import seccomp

_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000


def _decode(program: bytes) -> list:
    return [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]


def _run(code: list, nr: int, arch: int, args: tuple = ()) -> int:
    """What the filter returns for one call, as the kernel's interpreter
    would compute it (the instructions the builder uses, no more)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(tuple(args) + (0,) * (6 - len(args))))
    pc, acc, steps = 0, 0, 0
    while True:
        steps += 1
        assert steps <= len(code), "the filter loops"
        op, jt, jf, k = code[pc]
        pc += 1
        if op == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif op == 0x06:  # ret k
            return k
        elif op in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = acc == k if op == 0x15 else acc >= k if op == 0x35 else bool(acc & k)
            pc += jt if taken else jf
        else:
            raise AssertionError(f"an instruction the builder does not make: {op:#x}")


def _declared(rule: tuple, args: tuple) -> int:
    """The rule's verdict, read from its declaration, not from the program."""
    low = [a & 0xFFFFFFFF for a in args]
    kind = rule[0]
    if kind == "refuse":
        return _ERRNO | rule[1]
    if kind == "self":
        allowed = all(low[i] == 0 for i in rule[1:])
    elif kind == "self_or_zero":
        allowed = low[rule[1]] == 0 or args[rule[2]] == 0
    elif kind == "self_or_pretend":
        if low[rule[1]] != 0 and args[rule[2]] == 0:
            return _ERRNO | 0  # success, nothing done
        allowed = low[rule[1]] == 0
    elif kind == "which_self":
        allowed = low[rule[3]] == 0 and low[rule[1]] in rule[2]
    else:  # no_setid
        allowed = not low[rule[1]] & 0o6000
    return _ALLOW if allowed else _ERRNO | 1


@pytest.mark.parametrize("machine", sorted(seccomp.TABLES))
def test_every_number_gets_what_its_rule_declares(machine):
    arch, numbers = seccomp.TABLES[machine]
    code = _decode(seccomp.build(machine))
    by_number = {number: seccomp._RULES[name] for name, number in numbers.items()}
    values = (0, 1, 2, 0o644, 0o4755, 0o2000, 1 << 32)
    for nr in range(0, 1024):
        rule = by_number.get(nr)
        if rule is None or rule[0] == "refuse":
            expected = _ALLOW if rule is None else _declared(rule, ())
            assert _run(code, nr, arch, (5, 6, 7)) == expected, (machine, nr)
            continue
        for args in itertools.product(values, repeat=4):
            assert _run(code, nr, arch, args) == _declared(rule, args), (machine, nr, args)


@pytest.mark.parametrize("machine", sorted(seccomp.TABLES))
def test_other_abis_are_refused(machine):
    arch, numbers = seccomp.TABLES[machine]
    code = _decode(seccomp.build(machine))
    enosys = _ERRNO | 38
    assert _run(code, 0, arch ^ 1) == enosys  # another AUDIT_ARCH
    for nr in (0, 1, 59, numbers["openat"]):
        assert _run(code, nr | 0x40000000, arch) == enosys  # x32


def test_the_tree_keeps_the_program_short():
    """The kernel runs the filter once per number when it installs it;
    a number decided without argument checks takes few instructions."""
    arch, numbers = seccomp.TABLES["x86_64"]
    program = seccomp.build("x86_64")
    assert len(program) // 8 <= 2 * len(numbers) + 60


def test_an_unknown_machine_gets_no_filter():
    assert seccomp.build("vax") == b""
