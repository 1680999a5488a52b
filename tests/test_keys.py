"""Secret keys and the reserved '!'."""

import pytest

from sbus.keys import Credentials, KeyRefused, KeyRules

ME = Credentials(gid=100, uid=1000, pid=1111)
rules = KeyRules()


def test_credentials_path():
    assert ME.path() == b"!/cred/100/1000/1111"
    assert Credentials.parse(b"!/cred/100/1000/1111/!/cred/1/2/3") == ME


@pytest.mark.parametrize("pattern, filled", [
    (b"!/cred/100/1000/1111/x", b"!/cred/100/1000/1111/x"),
    (b"!/cred////", b"!/cred/100/1000/1111/"),
    (b"!/cred//1000//a/*", b"!/cred/100/1000/1111/a/*"),
    (b"!/cred/100/1000/1111/!/cred/7/8/9/x", b"!/cred/100/1000/1111/!/cred/7/8/9/x"),
    (b"plain/*", b"plain/*"),
    (b"", b""),
    (b"!foo/bar", b"!foo/bar"),  # '!' with another byte beside it is not reserved
])
def test_patterns_accepted(pattern, filled):
    assert rules.check_pattern(pattern, ME) == filled


@pytest.mark.parametrize("pattern, why", [
    (b"!/cred/100/1000/1112/x", "names PID 1112"),
    (b"!/cred/100/1001//x", "names UID 1001"),
    (b"!/cred/*/*/*/", "wildcard in the GID field"),
    (b"!/cred//*//", "wildcard in the UID field"),
    (b"!/cred/", "truncated"),
    (b"!/cred/100/1000/1111", "truncated"),
    (b"!/", "truncated"),
    (b"!/cred/0100/1000/1111/", "names GID 0100"),
    (b"!/cred/1a/1000/1111/", "not decimal"),
    (b"a/!/b", "reserved"),
    (b"!", "reserved"),
])
def test_patterns_refused(pattern, why):
    with pytest.raises(KeyRefused, match=why):
        rules.check_pattern(pattern, ME)


@pytest.mark.parametrize("key", [b"!/cred/1/2/3/x", b"!/cred/1/2/3/", b"a/b", b"!x", b"",
                                 b"!/cred/1/2/3/!/cred/4/5/6/y"])
def test_keys_accepted(key):
    rules.check_key(key)


@pytest.mark.parametrize("key", [b"!/cred/1/2/3", b"!/x", b"!/cred/a/2/3/x", b"a/!", b"!",
                                 b"!/cred/1/2/3/!/x"])
def test_keys_refused(key):
    with pytest.raises(KeyRefused):
        rules.check_key(key)


def test_dot_dialect():
    dots = KeyRules(b".")
    assert dots.check_pattern(b"!.cred....", ME) == b"!.cred.100.1000.1111."
    assert ME.path(b".") == b"!.cred.100.1000.1111"
