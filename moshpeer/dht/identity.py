"""A peer's identity: one RSA key that is both its libp2p identity and its record-signing key.

Using one key for both binds the two: the peer id that libp2p derives from the key is the only
peer id the key can sign records for (see `peer_id_from_owner_key`). A persistent identity file
keeps the peer id across restarts; without one the peer gets a fresh key per process.

The file format is hivemind's (and libp2p's): a protobuf `PrivateKey{key_type=RSA, data=DER}`,
so a file written by hivemind (`P2P.generate_identity`) works here and vice versa.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Optional

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from moshpeer.errors import ProtocolError, UserError

# An identity file holds one 2048-bit key (about 1.2 KB); anything far larger is not one.
_MAX_IDENTITY_FILE_BYTES = 64 * 1024
# Identities below this strength are refused, ours and others': a 1024-bit key costs ~30 ms to mint (Sybils by
# the thousand) and is within reach of factoring. hivemind generates 2048-bit keys.
MIN_RSA_BITS = 2048
# libp2p peer ids of RSA keys: multihash(sha2-256) of the protobuf-encoded public key.
_MULTIHASH_SHA2_256 = bytes([0x12, 0x20])
# A subkey that is exactly one `[owner:<key>]` marker and nothing else.
_OWNER_KEY_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


def _private_key_from_der(der: bytes) -> RSAPrivateKey:
    """Wrap a DER-encoded RSA key in hivemind's RSAPrivateKey (its constructor would generate a new key); raises
    ValueError for another kind of key or one below MIN_RSA_BITS."""
    loaded = serialization.load_der_private_key(der, password=None)
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise ValueError("not an RSA private key")
    if loaded.key_size < MIN_RSA_BITS:
        raise ValueError(f"a {loaded.key_size}-bit RSA key is too weak (at least {MIN_RSA_BITS} bits)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own unpickling path, which loads DER
    return key


def peer_id_bytes_from_public_key(public_key: RSAPublicKey) -> bytes:
    """The binary libp2p peer id (multihash, what hivemind's `PeerID.to_bytes()` holds) of an RSA public key."""
    der = serialization.load_ssh_public_key(public_key.to_bytes()).public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return _MULTIHASH_SHA2_256 + hashlib.sha256(encoded).digest()


def peer_id_from_public_key(public_key: RSAPublicKey) -> str:
    """The base58 libp2p peer id of an RSA public key (same rule as p2pd and hivemind's PeerID.from_identity)."""
    return base58.b58encode(peer_id_bytes_from_public_key(public_key)).decode()


def peer_id_from_owner_key(owner_subkey: bytes) -> Optional[str]:
    """Peer id of the key inside an `[owner:<ssh-rsa key>]` marker, or None if it is not exactly one valid marker
    of an RSA key of at least MIN_RSA_BITS (a weaker key is cheap to mint by the thousand, or to break)."""
    match = _OWNER_KEY_RE.fullmatch(owner_subkey)
    if match is None:
        return None
    try:
        parsed = serialization.load_ssh_public_key(match.group(1))
        if not isinstance(parsed, rsa.RSAPublicKey) or parsed.key_size < MIN_RSA_BITS:
            return None
        return peer_id_from_public_key(RSAPublicKey(parsed))
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None


def load_public_key(data: bytes) -> RSAPublicKey:
    """A peer's RSA public key from its OpenSSH bytes (as it sends them); ProtocolError if they are not one."""
    try:
        return RSAPublicKey.from_bytes(data)
    except Exception:  # cryptography raises several types for malformed keys
        raise ProtocolError("not an RSA public key") from None


@dataclass(frozen=True)
class Identity:
    """An RSA private key with its libp2p peer id and the DHT subkey that marks records it owns."""

    private_key: RSAPrivateKey
    path: Optional[str] = None  # the persistent identity file, None for an ephemeral identity

    @property
    def public_key(self) -> RSAPublicKey:
        return self.private_key.get_public_key()

    # Derived once (a key never changes; bytes, so an Identity still pickles): every round asks for them, and
    # each costs a key serialization.
    @functools.cached_property
    def public_key_bytes(self) -> bytes:
        """The public key in OpenSSH form, as peers send it to each other."""
        return self.public_key.to_bytes()

    @functools.cached_property
    def peer_id(self) -> str:
        """Base58 libp2p peer id, exactly what p2pd reports for this key."""
        return base58.b58encode(self.peer_id_bytes).decode()

    @functools.cached_property
    def peer_id_bytes(self) -> bytes:
        """Binary libp2p peer id (hivemind's `PeerID.to_bytes()`), as matchmaking names group members."""
        return peer_id_bytes_from_public_key(self.public_key)

    @functools.cached_property
    def owner_subkey(self) -> bytes:
        """The `[owner:...]` marker: a record stored under this subkey must carry this key's signature."""
        return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", self.public_key_bytes)

    def signature_validator(self) -> RSASignatureValidator:
        """hivemind's validator that signs our records with this key and checks everyone's signatures."""
        return RSASignatureValidator(self.private_key)

    def to_file_bytes(self) -> bytes:
        """The identity file contents (libp2p protobuf PrivateKey)."""
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=self.private_key.to_bytes()).SerializeToString()

    @classmethod
    def generate(cls) -> "Identity":
        """A fresh random 2048-bit RSA identity."""
        return cls(RSAPrivateKey())

    @classmethod
    def from_file_bytes(cls, data: bytes, path: Optional[str] = None) -> "Identity":
        """Parse identity file contents; raises ValueError if they are not an RSA private key."""
        try:
            message = crypto_pb2.PrivateKey.FromString(data)
        except Exception as e:  # protobuf raises DecodeError, which is not a ValueError
            raise ValueError(f"not a libp2p private key ({e})") from None
        if message.key_type != crypto_pb2.RSA:
            raise ValueError("only RSA identities are supported (hivemind signs records with RSA)")
        return cls(_private_key_from_der(message.data), path=path)

    @classmethod
    def load(cls, path: str) -> "Identity":
        """Read an existing identity file; any problem with it is a `UserError`."""
        try:
            if os.path.getsize(path) > _MAX_IDENTITY_FILE_BYTES:
                raise UserError(f"identity file {path} is too large to be a private key")
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UserError(f"cannot read identity file {path}: {e.strerror}") from None
        try:
            return cls.from_file_bytes(data, path=path)
        except ValueError as e:
            raise UserError(f"identity file {path} is not a valid private key: {e}") from None

    @classmethod
    def load_or_create(cls, path: str) -> "Identity":
        """Load `path`, or create it with a new key (written atomically, readable by the owner only)."""
        path = os.path.abspath(os.path.expanduser(path))
        if os.path.lexists(path):
            if os.path.isdir(path):
                raise UserError(f"identity path {path} is a directory, expected a key file")
            return cls.load(path)
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            raise UserError(f"cannot create identity file {path}: directory {directory} does not exist")
        identity = cls.generate()
        try:
            write_private_file(path, identity.to_file_bytes())
        except OSError as e:
            raise UserError(f"cannot write identity file {path}: {e.strerror}") from None
        return cls(identity.private_key, path=path)


def write_private_file(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file, fsync, rename), mode 0600."""
    directory = os.path.dirname(path)
    fd, tmp_path = tempfile.mkstemp(prefix=".identity-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o600)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

