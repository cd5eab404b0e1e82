"""The credentials of a deployment across hospitals (README "Deploying across hospitals"): the federation's CA and
the SuperLink's TLS certificate (made, renewed without touching a site), each site's node key for SuperNode
authentication, and the checks each party makes of its files before it starts a Flower process (a missing, expired or
mismatched file named, with what to do). No PyTorch: a site's IT checks its files without the training stack."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from fedsilo.config import ConfigError

CA_DAYS = 3650  # the federation CA outlives many server certificates: renewing the SuperLink's touches no site
EXPIRY_WARN_DAYS = 30


def make_certificates(out: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365,
                      ca_days: int = CA_DAYS) -> dict[str, Path]:
    """A certificate authority of the federation's own (valid ``ca_days``) and the SuperLink's TLS certificate signed
    by it (valid ``days``), valid for ``hosts`` (IP addresses and DNS names the sites dial). Writes ``ca.crt`` (what
    every site and the coordinator's CLI trust), ``ca.key``, ``server.pem`` and ``server.key`` (private keys 0600).
    The SuperLink serves its Fleet, Control and Runtime APIs with them; ``ca.key`` stays with the coordinator: it
    signs the renewed server certificate (:func:`renew_server_certificate`), so the sites keep their ``ca.crt``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    _subject_alt_names(hosts)  # refused before anything is made
    if ca_days < days:
        raise ConfigError(f"--ca-days: {ca_days}; the CA must stay valid at least as long as the SuperLink's certificate (--days {days})")
    now = _cert_start()
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedsilo federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=ca_days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    server, key = _server_certificate(ca, ca_key, hosts, days, now)
    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": (ca.public_bytes(pem), False),
        "server.pem": (server.public_bytes(pem), False),
        "ca.key": (ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True),
        "server.key": (key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True),
    }
    return _write_secret_files(Path(out), files)


def _cert_start():
    import datetime

    return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)  # a site's clock a little behind


def _subject_alt_names(hosts: tuple[str, ...]) -> list:
    import ipaddress

    from cryptography import x509

    if not hosts:
        raise ConfigError("--host: the SuperLink's certificate needs at least one address or name")
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    return sans


def _server_certificate(ca, ca_key, hosts: tuple[str, ...], days: int, now) -> tuple[Any, Any]:
    """The SuperLink's certificate for ``hosts`` and its new key, signed by the CA, valid ``days`` from ``now``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ConfigError(f"--days: {days}; a certificate must be valid for at least a day")
    key = ec.generate_private_key(ec.SECP384R1())
    cn = hosts[0] if len(hosts[0]) <= 64 else "fedsilo SuperLink"  # X.509 caps a common name at 64; the SANs are what TLS checks
    server = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
              .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.SubjectAlternativeName(_subject_alt_names(hosts)), critical=False)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA384()))
    return server, key


def renew_server_certificate(certs: Path, hosts: Optional[tuple[str, ...]] = None, days: int = 365) -> dict[str, Any]:
    """A new SuperLink certificate and key in ``certs`` (``server.pem``, ``server.key``), signed by the federation CA
    kept there (``ca.crt``, ``ca.key``), for ``hosts`` (default: the names the old certificate holds). The sites'
    ``ca.crt`` stays valid: nothing is sent to them; the SuperLink serves the new certificate once restarted. The old
    pair is kept as ``server.pem.old`` / ``server.key.old``. Refused when the CA would expire first (a new CA means a
    new ``ca.crt`` at every site: ``deploy certs`` into a new folder)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    certs = Path(certs)
    missing = [n for n in ("ca.crt", "ca.key") if not (certs / n).is_file()]
    if missing:
        raise ConfigError(f"--out: {certs} lacks {', '.join(missing)}: the federation CA that signs the SuperLink's certificate "
                          "(made by `fedsilo deploy certs`; only the coordinator holds ca.key)")
    ca_key = _load_pem_key(certs / "ca.key", "--out")
    mine = [c for c in _load_certificates(certs / "ca.crt", "--out") if c.public_key().public_numbers() == ca_key.public_key().public_numbers()]
    if not mine:
        raise ConfigError(f"--out: {certs / 'ca.key'} is not the key of {certs / 'ca.crt'}")
    ca = mine[0]
    old = _load_certificate(certs / "server.pem", "--out") if (certs / "server.pem").is_file() else None
    if hosts is None:
        if old is None:
            raise ConfigError(f"--host: {certs} holds no server.pem to take the SuperLink's names from; give --host")
        names = old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = tuple(str(n.value) for n in names if isinstance(n, (x509.IPAddress, x509.DNSName)))  # in order: CN first
    now = _cert_start()
    if now + datetime.timedelta(days=days) > ca.not_valid_after_utc:
        raise ConfigError(f"--days: {days}; the federation CA ({certs / 'ca.crt'}) expires on {ca.not_valid_after_utc:%Y-%m-%d}, "
                          "before the new certificate would: make a new CA with `fedsilo deploy certs --out <new folder>` and "
                          "send its ca.crt to every site, or give fewer --days")
    server, key = _server_certificate(ca, ca_key, tuple(hosts), days, now)
    pem = serialization.Encoding.PEM
    new = {"server.key": (key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), 0o600),
           "server.pem": (server.public_bytes(pem), 0o644)}
    _swap_in(certs, new)
    return {"server.pem": certs / "server.pem", "server.key": certs / "server.key", "hosts": list(hosts),
            "valid_until": server.not_valid_after_utc, "previous_until": old.not_valid_after_utc if old is not None else None}


def _swap_in(folder: Path, new: dict[str, tuple[bytes, int]]) -> None:
    """Put the files ``new`` (name -> (bytes, mode)) in ``folder``, the ones they replace kept as ``<name>.old``: every
    new file is written before any old one moves, each gets the owner of the file it replaces (a renewal run with
    sudo leaves the SuperLink's account able to read its key), and a failure while swapping puts the old files back."""
    staged = {n: folder / f".{n}.renewing" for n in new}
    moved: list[str] = []
    try:
        for n, (data, mode) in new.items():
            staged[n].unlink(missing_ok=True)
            with os.fdopen(os.open(staged[n], os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as fh:
                fh.write(data)
            if (folder / n).is_file():
                st = (folder / n).stat()
                if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                    os.chown(staged[n], st.st_uid, st.st_gid)
        for n in new:
            if (folder / n).is_file():
                os.replace(folder / n, folder / f"{n}.old")
                os.chmod(folder / f"{n}.old", new[n][1])  # an old private key stays as private as the new one
            moved.append(n)
            os.replace(staged[n], folder / n)
    except BaseException:
        for n in moved:  # back as they were: the old pair, never half of each
            if (folder / f"{n}.old").is_file():
                os.replace(folder / f"{n}.old", folder / n)
        raise
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)


# ----------------------------------------------------- the checks each party makes before it becomes a Flower process
# Flower ends every failed start with exit status 1 (its own exit code is only logged), so a service manager cannot
# tell an unreadable key or an expired certificate, which no restart mends, from a SuperLink that is not up yet. fedsilo
# checks what it can before it becomes flower-supernode / flower-superlink and refuses with exit status 2, which the
# systemd units it writes never restart.
def _read(path: Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:  # missing, or not readable by this account (a key is its owner's only)
        raise ConfigError(f"{flag}: {path}: {e.strerror or e}") from e


def _load_pem_key(path: Path, flag: str):
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_private_key(_read(path, flag), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{flag}: {path} is not an unencrypted PEM private key ({e})") from e


def _load_certificate(path: Path, flag: str):
    return _load_certificates(path, flag)[0]


def _load_certificates(path: Path, flag: str) -> list:
    """Every certificate of a PEM file (a CA bundle holds several: the old CA and the new one while sites change)."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(_read(path, flag))
    except ValueError as e:
        raise ConfigError(f"{flag}: {path} is not a PEM certificate ({e})") from e


def _is_ca(cert) -> bool:
    from cryptography import x509

    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _valid_ca(path: Path, flag: str, now):
    """The CA certificate of ``path`` valid now that lasts longest (a bundle during a change of CA holds several)."""
    cas = [c for c in _load_certificates(path, flag) if _is_ca(c)]
    if not cas:
        raise ConfigError(f"{flag}: {path} holds no CA certificate (give the federation's ca.crt, not the SuperLink's server.pem)")
    valid = [c for c in cas if c.not_valid_before_utc <= now <= c.not_valid_after_utc]
    if not valid:
        _check_dates(cas[0], path, flag, now)  # the reason, dated
    return max(valid, key=lambda c: c.not_valid_after_utc)


def _check_dates(cert, path: Path, flag: str, now) -> None:
    if now < cert.not_valid_before_utc:
        raise ConfigError(f"{flag}: {path} is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this machine's clock right?)")
    if now > cert.not_valid_after_utc:
        raise ConfigError(f"{flag}: {path} expired on {cert.not_valid_after_utc:%Y-%m-%d}")


def check_site_credentials(root_certificates: Path, auth_key: Path, now=None) -> list[str]:
    """A site's TLS trust (``ca.crt``: a CA certificate, valid now) and its SuperNode key (an OpenSSH elliptic-curve
    private key, as ``deploy key`` writes it), each refused by flag. Returns warnings (the CA expires within 30 days)."""
    import datetime

    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca = _valid_ca(root_certificates, "--root-certificates", now)
    try:
        key = load_ssh_private_key(_read(auth_key, "--auth-key"), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--auth-key: {auth_key} is not an unencrypted OpenSSH private key ({e}); make one with `fedsilo deploy key`") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"--auth-key: {auth_key} is a {type(key).__name__.lstrip('_')}; Flower's node authentication takes an "
                          "elliptic-curve key (`fedsilo deploy key`)")
    return _expiry_warning("the federation CA", root_certificates, ca, now, "ask the coordinator for the new ca.crt")


def check_superlink_certificates(certs: Path, now=None) -> dict[str, Any]:
    """The coordinator's ``certs``: ``server.pem`` signed by ``ca.crt``, ``server.key`` its key, both valid now;
    refused by ``--certs`` naming the file. Returns when each expires and warnings (within 30 days)."""
    import datetime

    from cryptography.exceptions import InvalidSignature

    now = now or datetime.datetime.now(datetime.timezone.utc)
    certs = Path(certs)
    server = _load_certificate(certs / "server.pem", "--certs")
    signers, reasons = [], []
    for c in (c for c in _load_certificates(certs / "ca.crt", "--certs") if _is_ca(c)):  # a bundle: the CA that signed it
        try:
            server.verify_directly_issued_by(c)
            signers.append(c)
        except (ValueError, TypeError, InvalidSignature) as e:
            reasons.append(str(e) or type(e).__name__)
    if not signers:
        raise ConfigError(f"--certs: {certs / 'server.pem'} is not signed by a CA of {certs / 'ca.crt'} "
                          f"({'; '.join(reasons) or 'it holds no CA certificate'}); the sites would refuse it")
    ca = signers[0]
    key = _load_pem_key(certs / "server.key", "--certs")
    if key.public_key().public_numbers() != server.public_key().public_numbers():
        raise ConfigError(f"--certs: {certs / 'server.key'} is not the key of {certs / 'server.pem'} (renewed one without the other?)")
    for name, cert in (("ca.crt", ca), ("server.pem", server)):
        _check_dates(cert, certs / name, "--certs", now)
    warnings = _expiry_warning("the SuperLink's certificate", certs / "server.pem", server, now,
                               f"renew it: fedsilo deploy certs --renew --out {certs}, then restart the SuperLink")
    warnings += _expiry_warning("the federation CA", certs / "ca.crt", ca, now,
                                "make a new CA (`fedsilo deploy certs --out <new folder>`) and send its ca.crt to every site")
    return {"ca.crt": ca.not_valid_after_utc.isoformat(), "server.pem": server.not_valid_after_utc.isoformat(), "warnings": warnings}


def _expiry_warning(what: str, path: Path, cert, now, what_to_do: str) -> list[str]:
    """A warning, when ``cert`` expires within :data:`EXPIRY_WARN_DAYS`."""
    left = cert.not_valid_after_utc - now
    if left.days >= EXPIRY_WARN_DAYS:
        return []
    return [f"warning: {what} ({path}) expires in {left.days} days, on {cert.not_valid_after_utc:%Y-%m-%d}: {what_to_do}"]


def make_node_key(out: Path, name: str) -> dict[str, Path]:
    """A SuperNode's authentication key pair in the OpenSSH format Flower reads (ECDSA on NIST P-384): ``<name>``
    (private, 0600, stays at the site: ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub`` (sent to
    the coordinator, who registers it: ``flwr supernode register``)."""
    import re

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"--name: {name!r}; a site's key name is letters, digits, '_', '.', '-' (it names files in --out)")
    key = ec.generate_private_key(ec.SECP384R1())
    files = {
        name: (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()), True),
        f"{name}.pub": (key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                        + f" fedsilo-{name}\n".encode(), False),
    }
    return _write_secret_files(Path(out), files)


def _write_secret_files(out: Path, files: dict[str, tuple[bytes, bool]]) -> dict[str, Path]:
    """Write (file -> (bytes, private)); none when one exists already (a key in use is never replaced); private
    keys readable by their owner only (0600)."""
    out.mkdir(parents=True, exist_ok=True)
    clash = [n for n in files if (out / n).exists()]
    if clash:
        raise ConfigError(f"{out}: {', '.join(clash)} already exist; remove them or choose another folder (a key in use is never replaced)")
    paths = {}
    for n, (data, private) in files.items():
        fd = os.open(out / n, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        paths[n] = out / n
    return paths
