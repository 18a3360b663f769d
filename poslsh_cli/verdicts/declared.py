"""Every claim the tool judges, declared once: its id, the command that judges it, its sentence, the
rule, the metric, the two sides it compares (as scheme fields, never labels) and its role.

A command makes a verdict only through its claim's :meth:`Claim.verdict`, which fills the sentence
and sets the verdict's ids (:class:`~poslsh_cli.verdicts.claims.Verdict` ``key``, ``claim_id``,
``family``); readers (report, publish, the side-by-side table) join, group and fold verdicts by those
ids and fields, never by a sentence, so rewording a claim here changes no table's rows. ``poslsh
claims`` lists the declarations.

A claim made of each of several members (each s, each model, each task) is one declaration with
``family=True``: its sentence holds ``{member}`` where the members differ, and each verdict names its
member. Other ``{fields}`` of a sentence (a number of the run: its s, its length) are filled at the
verdict; the README shows a family's sentence with "…" for the member.
"""
from __future__ import annotations

import enum
import string
from dataclasses import dataclass, field
from typing import Any, Mapping

from poslsh_cli.verdicts.claims import Status, Verdict


class Role(enum.Enum):
    """What a verdict of the claim may conclude: ``primary``, a registered confirmatory endpoint
    (docs/PREREGISTRATION*.md); ``exploratory``, a verdict of an unregistered run (a registered run's
    exploratory claims become secondary estimates there, :func:`...perplexity.registered.secondary`)."""

    PRIMARY = "primary"
    EXPLORATORY = "exploratory"


#: every declared claim by its id, in declaration order
CLAIMS: dict[str, "Claim"] = {}


@dataclass(eq=False)
class Claim:
    """One claim of the paper or of the tool, as its command judges it (module docstring)."""

    id: str
    command: str
    text: str
    rule: str = ""
    #: what the verdict is computed on (a results column, or what the command measures)
    metric: str = ""
    #: (baseline, compared): each a mapping of scheme fields (``position``/``method``, ``s``, ...); a
    #: field's value "*" where each member has its own (the member names it); () where nothing is compared
    sides: tuple[Mapping[str, Any], ...] = ()
    role: Role = Role.EXPLORATORY
    family: bool = False
    #: the placeholders of the sentence (besides ``member``) and of the rule, filled at each verdict
    fields: tuple[str, ...] = field(init=False, default=())
    rule_fields: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.id in CLAIMS:
            raise ValueError(f"claim {self.id!r} is declared twice")
        names = tuple(f for _, f, _, _ in string.Formatter().parse(self.text) if f)
        if self.family != ("member" in names):
            raise ValueError(f"claim {self.id!r}: a family's sentence, and only a family's, holds {{member}}")
        if self.sides and len(self.sides) != 2:
            raise ValueError(f"claim {self.id!r}: sides are (baseline, compared)")
        self.fields = tuple(n for n in names if n != "member")
        self.rule_fields = tuple(f for _, f, _, _ in string.Formatter().parse(self.rule) if f)
        CLAIMS[self.id] = self

    def sentence(self, member: str = "…", **fields: Any) -> str:
        """The claim's sentence with its fields filled (a family's member "…": the family's sentence)."""
        fields = {k: v for k, v in fields.items() if k in self.fields}
        return self.text.format(member=member, **fields) if self.family else self.text.format(**fields)

    def rule_for(self, **fields: Any) -> str:
        """The declared rule with the run's numbers it names filled from ``fields``."""
        return self.rule.format(**{k: fields[k] for k in self.rule_fields}) if self.rule_fields else self.rule

    def verdict(self, status: Status, evidence: str, numbers: dict | None = None, *, rule: str | None = None,
                member: str = "", key: str = "", tag: str = "", group: str = "", **fields: Any) -> Verdict:
        """The verdict of this claim (of its ``member``, for a family): its sentence filled from ``fields``,
        then ``tag`` (what it is restricted to: "[600 steps]"); ``rule`` where the run's numbers enter it
        beyond the declared rule's fields; ``key`` the verdict's own id where one claim is judged in
        several settings of a run (default: the claim's id, with ``[member]`` for a family's member);
        ``group`` splits a family where its sentence's fields differ (a task: the README folds the
        members of one family, group and tag into one row)."""
        if self.family and not member:
            raise ValueError(f"claim {self.id!r} is a family: its verdict names its member")
        key = key or (f"{self.id}[{member}]" if self.family else self.id)
        family = {"family": f"{self.id}[{group}]" if group else self.id, "family_text": self.sentence(**fields),
                  "member": member, "tag": tag} if self.family else {"tag": tag}
        if rule is None:
            rule = self.rule_for(**fields)
        text = self.sentence(member, **fields) if self.family else self.sentence(**fields)
        return Verdict(text + (f" {tag}" if tag else ""), status, evidence, rule, numbers, key=key, claim_id=self.id,
                       **family)

    def not_measured(self, why: str, **kwargs: Any) -> Verdict:
        """NOT MEASURED, and why."""
        return self.verdict(Status.NOT_MEASURED, why, **kwargs)


def listing(claims: list[Claim]) -> str:
    """The claims as Markdown, one block each: id, command, role, metric, sides, sentence, rule."""
    out = []
    for c in claims:
        sides = " against ".join(", ".join(f"{k}={v}" for k, v in side.items()) for side in reversed(c.sides))
        out.append(f"- **{c.id}** ({c.command}, {c.role.value}{', one claim per member' if c.family else ''})\n"
                   f"  - claim: {c.sentence(**{f: '{' + f + '}' for f in c.fields})}\n  - metric: {c.metric or '–'}\n  - compares: {sides or '–'}\n"
                   f"  - rule: {c.rule}")
    return "\n".join(out)


def claims_of(command: str) -> list[Claim]:
    """The claims a command judges, in declaration order (of the commands whose modules are imported:
    :func:`poslsh_cli.app.registry.experiments` imports them all)."""
    return [c for c in CLAIMS.values() if c.command == command]
