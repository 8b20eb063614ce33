"""Fixtures of the FP8 accuracy tests: the checkpoints of every format, made once per session,
and each one's reference numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import ALL_FORMATS, ALL_PLANTED_BUGS, build_original
from fp8_reference import (
    GREEDY_PROMPTS,
    GREEDY_TOKENS,
    ReferenceModel,
    TransformersModel,
    greedy,
    independent_reference,
    mean_abs_delta,
    scored_sequences,
    teacher_forced_logprobs,
)


@dataclass
class Fp8Case:
    """One quantized checkpoint and what its independent reference (independent_reference:
    transformers' loader or the float64 emulation) says about it."""

    name: str
    kind: str
    folder: Path
    sequences: torch.Tensor
    original: torch.Tensor  # teacher-forced logprobs of the unquantized original
    reference: torch.Tensor  # the same, of the reference
    reference_model: ReferenceModel | TransformersModel

    @property
    def emulation(self) -> torch.Tensor:
        """Teacher-forced logprobs of the float64 emulation (the reference itself, or beside
        transformers' loader where that is the reference)."""
        if isinstance(self.reference_model, ReferenceModel):
            return self.reference
        if not hasattr(self, "_emulation"):
            self._emulation = teacher_forced_logprobs(ReferenceModel(self.folder), self.sequences)
        return self._emulation

    @property
    def reference_error(self) -> float:
        return mean_abs_delta(self.reference, self.original)

    @property
    def weights_only(self) -> torch.Tensor:
        """Teacher-forced logprobs of the float64 emulation without its activation rounding."""
        if not hasattr(self, "_weights_only"):
            model = ReferenceModel(self.folder, round_activations=False)
            self._weights_only = teacher_forced_logprobs(model, self.sequences)
        return self._weights_only

    @property
    def near_tie_tolerance(self) -> float:
        """Twice the largest logprob change the format's rounding makes on the scored tokens
        (the reference's, against the original): where the reference scores another
        implementation's greedy choice less than that below its own, the choice is a near-tie
        that rounding may tip either way."""
        return 2 * float((self.reference - self.original).abs().max())

    def reference_greedy(self) -> list[list[int]]:
        if not hasattr(self, "_greedy"):
            self._greedy = [greedy(self.reference_model, p, GREEDY_TOKENS) for p in GREEDY_PROMPTS]
        return self._greedy


class _Originals(dict):
    """Model kind -> the folder of its unquantized original, built on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, kind: str) -> Path:
        self[kind] = build_original(kind, self.root / kind)
        return self[kind]


@pytest.fixture(scope="session")
def fp8_originals(tmp_path_factory) -> dict[str, Path]:
    return _Originals(tmp_path_factory.mktemp("fp8-originals"))


@pytest.fixture(scope="session")
def original_logprobs(fp8_originals):
    sequences = scored_sequences()
    made: dict[str, torch.Tensor] = {}

    def get(kind: str) -> torch.Tensor:
        if kind not in made:
            made[kind] = teacher_forced_logprobs(ReferenceModel(fp8_originals[kind]), sequences)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def fp8_case(tmp_path_factory, fp8_originals, original_logprobs):
    """fp8_case(name) -> Fp8Case for a format of fp8_checkpoints.ALL_FORMATS, made on first use."""
    root = tmp_path_factory.mktemp("fp8-checkpoints")
    made: dict[str, Fp8Case] = {}

    def get(name: str) -> Fp8Case:
        if name not in made:
            kind, maker = ALL_FORMATS[name]
            folder = maker(fp8_originals[kind], root / name)
            reference_model = independent_reference(folder)
            sequences = scored_sequences()
            made[name] = Fp8Case(
                name=name,
                kind=kind,
                folder=folder,
                sequences=sequences,
                original=original_logprobs(kind),
                reference=teacher_forced_logprobs(reference_model, sequences),
                reference_model=reference_model,
            )
        return made[name]

    return get


@pytest.fixture(scope="session")
def planted_bug(tmp_path_factory, fp8_case):
    """planted_bug(name) -> (the clean Fp8Case, the folder of its checkpoint with the bug)."""
    root = tmp_path_factory.mktemp("fp8-planted-bugs")
    made: dict[str, tuple[Fp8Case, Path]] = {}

    def get(name: str):
        if name not in made:
            format_name, plant = ALL_PLANTED_BUGS[name]
            case = fp8_case(format_name)
            made[name] = case, plant(case.folder, root / name)
        return made[name]

    return get
