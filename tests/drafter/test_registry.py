"""Methods are chosen by name through the one registry."""

from __future__ import annotations

import pytest

from drafter import registry
from drafter.method import DraftMethod
from drafter.ngram import NgramMethod


def test_ngram_is_registered_and_built_by_name():
    assert "ngram" in registry.method_names()
    assert registry.method_class("ngram") is NgramMethod
    method = registry.create("ngram", min_n=2, max_n=3)
    assert isinstance(method, NgramMethod)
    assert (method.min_n, method.max_n) == (2, 3)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown draft method 'eagle9'.*known: .*ngram"):
        registry.create("eagle9")


def test_unknown_option_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"no option model_dir; it takes: .*min_n"):
        registry.create("ngram", model_dir="/x")


def test_register_refuses_nameless_and_duplicate_names():
    class Nameless(NgramMethod):
        name = ""

    class Impostor(NgramMethod):
        name = "ngram"

    with pytest.raises(ValueError, match="no registry name"):
        registry.register(Nameless)
    with pytest.raises(ValueError, match="taken by drafter.ngram.NgramMethod"):
        registry.register(Impostor)
    with pytest.raises(TypeError):
        registry.register(int)
    assert registry.method_class("ngram") is NgramMethod
    assert issubclass(registry.method_class("ngram"), DraftMethod)
