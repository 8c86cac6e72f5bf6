"""The rule engine's contract: ordering, snapshots, locks, whitelist, violations."""

import pytest

from flotilla.resolution.engine import Env, Phase, ProviderGroup, Rule, ensure, rule, run
from flotilla.resolution.errors import ResolutionError, RuleContractError

DEFAULTS = {"a": 1, "b": None, "c": "x"}


def _run(steps, user=None, explicit=(), resolvable=frozenset({"a", "b", "c"})):
    values = {**DEFAULTS, **(user or {})}
    return run(
        [(Phase.NORMALISE, steps)],
        user=values,
        explicit=frozenset(explicit),
        defaults=DEFAULTS,
        resolvable=resolvable,
        model=None,
        platform=None,
    )


def test_later_rules_see_earlier_declarations_and_provenance_records_each_change():
    first = rule("first")(lambda v, m, p: {"a": v.a + 1})
    second = rule("second")(lambda v, m, p: {"b": v.a * 10})
    out = _run([first, second])
    assert out.values["a"] == 2 and out.values["b"] == 20
    assert [(c.field, c.old, c.new, c.rule) for c in out.provenance] == [
        ("a", 1, 2, "first"),
        ("b", None, 20, "second"),
    ]


def test_provider_group_members_share_one_snapshot_and_last_writer_wins():
    p1 = Rule("p1", lambda v, m, p: {"a": 5})
    p2 = Rule("p2", lambda v, m, p: {"b": v.a})  # reads the snapshot, not p1's 5
    p3 = Rule("p3", lambda v, m, p: {"a": 7})
    out = _run([ProviderGroup("providers", lambda model: [p1, p2, p3])])
    assert out.values["b"] == 1
    assert out.values["a"] == 7


def test_env_declarations_are_outputs_visible_to_later_rules():
    setter = rule("setter")(lambda v, m, p: {Env("SGLANG_X"): "True"})
    reader = rule("reader")(lambda v, m, p: {"c": v.env("SGLANG_X")})
    out = _run([setter, reader])
    assert out.env == {"SGLANG_X": "True"}
    assert out.values["c"] == "True"


def test_changing_an_explicit_field_needs_a_declared_override():
    sneaky = rule("sneaky")(lambda v, m, p: {"a": 3})
    with pytest.raises(RuleContractError, match="sneaky changed a"):
        _run([sneaky], user={"a": 2}, explicit={"a"})
    allowed = rule("allowed", overrides=("a",))(lambda v, m, p: {"a": 3})
    out = _run([allowed], user={"a": 2}, explicit={"a"})
    assert out.values["a"] == 3 and out.provenance[0].overrode_user


def test_redeclaring_the_users_own_value_is_not_an_override():
    same = rule("same")(lambda v, m, p: {"a": 2})
    out = _run([same], user={"a": 2}, explicit={"a"})
    assert not out.provenance[0].overrode_user


def test_whitelisted_rules_may_only_declare_resolvable_fields():
    bad = rule("bad", whitelist=True)(lambda v, m, p: {"c": "y"})
    with pytest.raises(RuleContractError, match="not model-overridable"):
        _run([bad], resolvable=frozenset({"a"}))


def test_unknown_fields_and_non_mapping_results_are_contract_errors():
    with pytest.raises(RuleContractError, match="not a server field"):
        _run([rule("typo")(lambda v, m, p: {"zz": 1})])
    with pytest.raises(RuleContractError, match="must return a mapping"):
        _run([rule("list")(lambda v, m, p: [1])])


def test_every_violation_is_collected_and_the_failing_rules_declarations_dropped():
    def two(v, m, p):
        ensure(False, "first problem")
        return {"a": 100}

    three = rule("three")(lambda v, m, p: ensure(v.a != 1, "second problem", kind="ValueError"))
    with pytest.raises(ResolutionError) as info:
        _run([rule("two")(two), three])
    messages = [v.message for v in info.value.violations]
    assert messages == ["first problem", "second problem"]
    assert [v.kind for v in info.value.violations] == ["AssertionError", "ValueError"]
    assert info.value.violations[0].rule == "two"


def test_the_view_is_read_only():
    def writer(v, m, p):
        v.a = 5

    with pytest.raises(AttributeError, match="read-only"):
        _run([rule("writer")(writer)])
