"""No secret in a log or an error, and key files that stay private.

A persistent URL that carries credentials or a signed query is refused at start-up with the
secret masked; every error that names a URL masks user information and query values. Keys made
by ``tierckpt certs`` are 0600 and never replaced without ``force``.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tierckpt.errors import AlreadyExistsError, InvalidArgumentError
from tierckptd.backends import open_backend, parse_url
from tierckptd.config import ConfigError, load_config
from tierckptd.redact import redact_text, redact_url

from ._util import run_daemon, snapshot

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"
SECRET_URLS = [
    f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/ckpt",
    f"s3://{SECRET}@bucket/ckpt",
    f"s3://bucket/ckpt?X-Amz-Credential=AKIA%2F20250101&X-Amz-Signature={SECRET}",
    f"gs://bucket/ckpt?token={SECRET}",
    f"file:///ckpt#{SECRET}",
    f"s3://[{SECRET}@bucket/ckpt",  # does not even parse as a URL
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_daemon_refuses_a_persistent_url_with_a_secret_and_never_echoes_it(tmp_path: Path, url: str) -> None:
    before = snapshot(tmp_path)
    p = run_daemon(tmp_path, "--listen", "127.0.0.1:0", "--insecure-listen", "--persistent", url)
    assert p.returncode == 2, p.stderr
    assert SECRET not in p.stderr + p.stdout and "AKIAIOSFODNN7EXAMPLE" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "persistent:" in lines[0] and "***" in lines[0]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("url", SECRET_URLS)
def test_config_and_backend_errors_mask_the_secret(url: str) -> None:
    for call in (lambda: load_config({"persistent": url}), lambda: parse_url(url), lambda: open_backend(url)):
        with pytest.raises(ConfigError) as e:
            call()
        assert SECRET not in str(e.value) and str(e.value).startswith("persistent: ")


@pytest.mark.parametrize(("url", "shown"), [
    ("s3://AK:SE@bucket/p", "s3://***@bucket/p"),
    ("s3://bucket/p?X-Amz-Signature=abc&versionId=3", "s3://bucket/p?X-Amz-Signature=***&versionId=***"),
    ("gs://bucket/p?token=abc#frag", "gs://bucket/p?token=***#***"),
    ("file:///srv/ckpt", "file:///srv/ckpt"),
    ("s3://bucket/prefix/", "s3://bucket/prefix/"),
    ("", ""),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_masks_urls_and_credential_pairs_in_prose() -> None:
    msg = (f"PUT https://bucket.s3.amazonaws.com/k?X-Amz-Credential=AKIA&X-Amz-Signature={SECRET} failed; "
           f"retrying with X-Amz-Security-Token={SECRET}, upload_id={SECRET} and s3://AK:{SECRET}@b/p.")
    out = redact_text(msg)
    assert SECRET not in out and "https://bucket.s3.amazonaws.com/k" in out and "s3://***@b/p" in out
    assert redact_text("get s3://bucket/ckpt/a: no such object") == "get s3://bucket/ckpt/a: no such object"


def test_s3_backend_reports_a_redacted_url() -> None:
    from tierckptd.backends.s3 import S3Backend

    b = S3Backend("bucket", "ckpt/", url=f"s3://AK:{SECRET}@bucket/ckpt/")
    try:
        assert SECRET not in b.url and SECRET not in repr(b)
    finally:
        b.close()


# -- tierckpt certs: private keys stay private -----------------------------------------------------

def test_certs_modes_and_no_silent_key_replacement(tmp_path: Path) -> None:
    from tierckpt.certs import make_ca, make_node_cert

    ca = make_ca(tmp_path / "ca", days=30)
    node = make_node_cert(tmp_path / "ca", "node_7", tmp_path / "n", sans=("n7.example", "10.0.0.7"), days=10)
    for path, mode in ((ca.key, 0o600), (ca.cert, 0o644), (node.key, 0o600), (node.cert, 0o644), (node.ca, 0o644)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    before = snapshot(tmp_path)
    with pytest.raises(AlreadyExistsError, match="node.key exists"):
        make_node_cert(tmp_path / "ca", "node_7", tmp_path / "n")
    with pytest.raises(AlreadyExistsError, match="ca.key exists"):
        make_ca(tmp_path / "ca")
    with pytest.raises(InvalidArgumentError, match="san"):
        make_node_cert(tmp_path / "ca", "n8", tmp_path / "n8", sans=("bad name!",))
    with pytest.raises(InvalidArgumentError, match="node_id"):
        make_node_cert(tmp_path / "ca", "../x", tmp_path / "n9")
    assert snapshot(tmp_path) == before  # refusals change nothing
    old = node.key.read_bytes()
    make_node_cert(tmp_path / "ca", "node_7", tmp_path / "n", force=True)
    assert node.key.read_bytes() != old and stat.S_IMODE(node.key.stat().st_mode) == 0o600

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    cert = x509.load_pem_x509_certificate(node.cert.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node_7"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node_7"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert.read_bytes()))


def test_certs_cli_and_the_thin_client_without_cryptography(tmp_path: Path) -> None:
    # Importing the module (and the CLI) does not import cryptography ...
    code = "import sys, tierckpt.certs, tierckpt.cli; print('cryptography' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    # ... and without it, the command names the extra to install and writes nothing.
    code = ("import sys; sys.modules['cryptography'] = None\n"
            "from tierckpt.certs import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "certs", "ca", "--out", str(tmp_path / "ca")],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "pip install 'tierckpt[certs]'" in p.stderr
    assert not (tmp_path / "ca").exists()
