"""Which tests show the effect of each honored server field (a non-default value changes
what the runtime does), for ``tests/resolution/test_runtime_support.py``.

Each entry is ``"tests/<path>.py::<test function>"`` (``::<Class>::<method>`` for a method);
the table test checks that every honored field has at least one and that each named test
exists. A change that flips a field to ``honored`` adds its test here in the same commit.
"""

EVIDENCE: dict[str, tuple[str, ...]] = {
}
