"""Secure aggregation, SecAgg+ (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020; the protocol
of Bonawitz et al., CCS 2017, over a sparse graph of neighbours): the coordinator learns only the
sum of a round's updates (docs/explanation/secure-aggregation.md).

A round's clients are the vertices of a random regular graph (`neighbours`); each pair of
neighbours agrees on a mask by X25519 key agreement, and each client adds a self-mask. The masks
cancel in the sum; what a client that dropped after sharing its keys left uncancelled, and every
survivor's self-mask, the coordinator removes from Shamir shares its neighbours hold, t of which
reconstruct a secret and fewer say nothing. The stages, each a message each way:

1. advertise: a client sends two public keys (c: the channel its shares travel on; s: its masks).
2. share keys: it receives its neighbours' keys, Shamir-shares its self-mask seed b and its mask
   key s to them (each share encrypted with ChaCha20-Poly1305 under the channel key of that pair,
   so the coordinator relays what it cannot read), commits to b (SHA-256) and, where the setup
   asks (`Setup.checked`), sends a check of every share (`share_check`: a SHA-256 binding it
   to the round, its owner and its holder).
3. masked input: it receives the shares addressed to it (with their owners' checks) and sends
   its update, in fixed point in the ring Z_2^32 (Z_2^16 under wire.up = "int8": 2 bytes a
   value), plus its self-mask and +/- one mask per neighbour that shared. A share that does not
   decrypt or fails its owner's check is disputed: it is never revealed.
4. unmasking: told who sent a masked input and who dropped after sharing, it sends, per
   neighbour, the share of b (a survivor) or of s (dropped), never both, or "x" for a disputed
   one; and (`Setup.opens`) its own seed b, which its commitment must bear out.

Disputes are judged where the setup is `paired`: a client advertises a channel key per
neighbour, and a disputed share's "x" carries that pair's private key. The coordinator decrypts
the one share with it and blames the holder (the share is sound) or the owner (it is not); the
key shows only what that pair exchanged, one share of each secret each, below t.

Checked shares make a junk share cost its sender, not the round: the coordinator checks each
revealed share against its owner's check, so a share that fails it, from a holder that had the
check in stage 3 and did not dispute, proves the holder bad (it is blamed, and the run excludes
its device); any t shares that pass reconstruct the secret at once, with no search. A device
of an older fedseq sends no checks; its shares are reconstructed by trying subsets
(`robust_reconstruct`), those of holders not blamed first.

`SecAggClient` is a device's side, `SecAggServer` the coordinator's; each validates every message
it takes, and the server drops from the round (with the reason) a client that sends junk at any
stage. The sum does not depend on the keys or masks: decoded, it is the same arithmetic wherever
the round ran, so simulation, workers and a deployment agree bitwise. Cryptography comes from the
`cryptography` package (a device installs it with the `secagg` extra); Shamir's sharing over a
prime field is written here.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import random
import secrets
import struct
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Any,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import numpy as np

from fedseq.common.errors import ProtocolError

if TYPE_CHECKING:
    import torch

#: the rings a masked input may live in: Z_2^32 (4 bytes a value, as float32) or, under
#: wire.up = "int8", Z_2^16 (2 bytes a value); an element travels as the signed integer type
RINGS = {32: (np.uint32, np.int32), 16: (np.uint16, np.int16)}
#: Shamir's field: the Mersenne prime 2^521 - 1, above every 256-bit secret (a key or a seed)
PRIME = (1 << 521) - 1
SHARE_BYTES = 66  # a field element, big-endian
KEY_BYTES = 32
#: sender, receiver, the share of b, the share of s: what one encrypted share carries
_PLAIN = struct.Struct(f">II{SHARE_BYTES}s{SHARE_BYTES}s")
NONCE_BYTES = 12
TAG_BYTES = 16
CIPHER_BYTES = NONCE_BYTES + _PLAIN.size + TAG_BYTES
#: stage 4's answer for a neighbour whose share to this client was unusable (it reveals nothing)
DISPUTED = "x"
#: stage 4's entry in which a survivor opens its own seed b (an `opens` setup): checked against
#: its stage-2 commitment, it unmasks its self-mask without its holders' shares
OWN = "o"
#: a masked input's name in a device's update frame (the one tensor a secure update carries:
#: the ring elements as int32)
MASKED = "~masked"


def ring_bits_for(up: str) -> int:
    """The ring of a secure round whose updates would travel in wire codec `up`: 16 bits for
    "int8" (the levels of a client's value widened so that the round's sum cannot wrap), else
    32."""
    return 16 if up == "int8" else 32


class SecAggError(ProtocolError):
    """A secure round cannot go on (too few clients or shares), or a message in it is junk."""


# -- Shamir's secret sharing over GF(PRIME) ------------------------------------------------------
def shamir_share(secret: int, threshold: int, xs: Sequence[int]) -> Dict[int, int]:
    """Points (x, f(x)) of a random polynomial f of degree threshold - 1 with f(0) = secret, one
    per x (distinct, nonzero): any `threshold` of them give the secret, fewer say nothing."""
    if not 0 <= secret < PRIME:
        raise ValueError("a Shamir secret must lie in [0, PRIME)")
    if not 1 <= threshold <= len(xs) or len(set(xs)) != len(xs) or any(
            x % PRIME == 0 for x in xs):
        raise ValueError(f"threshold {threshold} of {len(xs)} distinct nonzero points")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x) for x in xs}


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    y = 0
    for c in reversed(coefficients):
        y = (y * x + c) % PRIME
    return y


def lagrange_at(points: Mapping[int, int], x: int) -> int:
    """The value at x of the polynomial through `points` (degree len(points) - 1)."""
    total = 0
    for xi, yi in points.items():
        num = den = 1
        for xj in points:
            if xj != xi:
                num = num * (x - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def shamir_reconstruct(points: Mapping[int, int]) -> int:
    """The secret (f(0)) from `threshold` or more points of one polynomial."""
    return lagrange_at(points, 0)


def robust_reconstruct(points: Mapping[int, int], threshold: int, valid, tries: int = 5000,
                       suspect: AbstractSet[int] = frozenset()
                       ) -> Tuple[Optional[int], List[int]]:
    """(the secret, the x whose points lie off its polynomial) from points some of which may be
    junk: the first `threshold`-subset whose secret passes `valid` (a commitment check) wins,
    subsets without a `suspect` x (a holder already blamed) tried first; (None, []) where no
    subset of the first `tries` does."""
    xs = sorted(points, key=lambda x: (x in suspect, x))
    if len(xs) < threshold:
        return None, []
    for subset in itertools.islice(itertools.combinations(xs, threshold), tries):
        chosen = {x: points[x] for x in subset}
        secret = shamir_reconstruct(chosen)
        if valid(secret):
            wrong = [x for x in xs if x not in chosen and lagrange_at(chosen, x) != points[x]]
            return secret, wrong
    return None, []


# -- the round's shape ---------------------------------------------------------------------------
def degree_for(clients: int, setting: Optional[int] = None) -> int:
    """k, each client's neighbours: `setting` where given, else Bell et al.'s logarithmic degree,
    2 ceil(log2 n) (every other client below 2 log2 n + 1); at most n - 1."""
    if clients <= 1:
        return 0
    k = setting if setting is not None else 2 * math.ceil(math.log2(clients))
    return min(clients - 1, k)


def threshold_for(degree: int, fraction: float) -> int:
    """t, the shares (of a client's k neighbours') that recover its secrets: floor(fraction k)
    + 1, at least 1, at most k."""
    return max(1, min(degree, int(fraction * degree) + 1))


def neighbours(clients: Sequence[int], degree: int, seed: int) -> Dict[int, List[int]]:
    """A random k-regular graph (a Harary graph over a seeded permutation of the clients; with
    an odd k and an even count, the opposite vertex joins; complete where k >= n - 1): each
    client's neighbours, ascending."""
    order = list(clients)
    random.Random(seed).shuffle(order)
    n = len(order)
    out: Dict[int, Set[int]] = {c: set() for c in order}
    if degree >= n - 1:
        return {c: sorted(x for x in order if x != c) for c in order}
    for i, c in enumerate(order):
        for j in range(1, degree // 2 + 1):
            out[c].update((order[(i + j) % n], order[(i - j) % n]))
        if degree % 2 and n % 2 == 0:
            out[c].add(order[(i + n // 2) % n])
    return {c: sorted(v) for c, v in out.items()}


@dataclass(frozen=True)
class Setup:
    """What every client of a secure round is told before it starts: the round, who takes
    part and with whom, the threshold, the vector's length and its fixed-point scale."""

    round: int
    graph: Dict[int, List[int]]  # client -> its neighbours
    threshold: int
    length: int  # ring elements in a masked input
    scale: float  # S: a value v travels as round(v S) mod 2^ring_bits
    clip_range: float  # B: every coordinate is clamped to [-B, B] before it is scaled
    ring_bits: int = 32  # the ring Z_2^ring_bits (RINGS)
    #: each share travels with its owner's check (share_check); False: a coordinator from
    #: before checks, which neither sends nor reads them
    checked: bool = False
    #: each survivor opens its own seed b in stage 4 (OWN), so no holder that disputes, lies or
    #: stays silent can keep a live client's self-mask on; False: a coordinator from before
    opens: bool = False
    #: a channel key per pair of neighbours (stage 1 advertises one per neighbour): a holder
    #: that disputes a share reveals that pair's private key in stage 4, and the coordinator,
    #: decrypting that one share, blames whichever of the two lied; False: one channel key per
    #: client (a coordinator from before), and a dispute blames nobody
    paired: bool = False

    @property
    def clients(self) -> List[int]:
        """The round's secure-sum clients, in order."""
        return sorted(self.graph)

    @property
    def dtype(self) -> Any:
        """The ring's elements as numpy holds them (unsigned: they wrap as the ring does)."""
        return RINGS[self.ring_bits][0]

    @property
    def weight_bound(self) -> float:
        """The largest weight a client may give its update: every client at it, times B, stays
        inside the ring's half at the round's scale (the sum cannot wrap)."""
        return (1 << (self.ring_bits - 1)) / (self.clip_range * self.scale * len(self.graph))


def scale_for(clients: int, max_weight: float, clip_range: float, ring_bits: int = 32) -> float:
    """S such that `clients` updates, each a weight <= max_weight times coordinates in [-B, B],
    sum to at most 2^(ring_bits - 1) - 1 in absolute value, each value's rounding (half a step)
    included: the signed sum cannot wrap around the ring."""
    room = (1 << (ring_bits - 1)) - 1 - clients
    if room <= 0:
        raise SecAggError(f"{clients} clients a round leave no room in a {ring_bits}-bit ring")
    return room / (clients * max_weight * clip_range)


# -- fixed point in Z_2^ring_bits ----------------------------------------------------------------
def encode(values: np.ndarray, scale: float, ring_bits: int = 32, toward_zero: bool = False
           ) -> np.ndarray:
    """float64 values (already clamped and weighted) -> ring elements: round(v S) mod
    2^ring_bits, to nearest or (`toward_zero`) truncated, which never grows a value's
    magnitude, so an encoded update's L2 norm stays within the norm it was clipped to."""
    scaled = np.asarray(values, dtype=np.float64) * scale
    ints = (np.trunc(scaled) if toward_zero else np.rint(scaled)).astype(np.int64)
    return (ints & ((1 << ring_bits) - 1)).astype(RINGS[ring_bits][0])


def decode(elements: np.ndarray, scale: float) -> np.ndarray:
    """Ring elements -> float64, read as signed integers of the ring's width over S."""
    return to_signed(elements).astype(np.float64) / scale


def to_signed(elements: np.ndarray) -> np.ndarray:
    """Ring elements as the signed integers a frame carries (the same bits)."""
    return elements.view(RINGS[8 * elements.dtype.itemsize][1])


def from_signed(values: np.ndarray, setup: Setup) -> np.ndarray:
    """A frame's signed integers back to `setup`'s ring elements; SecAggError where they are
    not of the ring's width."""
    if values.dtype != RINGS[setup.ring_bits][1]:
        raise SecAggError(f"a masked input is {values.dtype}, the round's ring is "
                          f"{setup.ring_bits}-bit")
    return values.view(setup.dtype)


Layout = List[Tuple[str, int]]  # (tensor name, elements), in the round's order


def vector_length(layout: Layout) -> int:
    """Ring elements of a masked input: every tensor's, then one weight per tensor."""
    return sum(n for _, n in layout) + len(layout)


def client_vector(deltas: Mapping[str, torch.Tensor], weight_of: Mapping[str, float],
                  layout: Layout, setup: Setup, toward_zero: bool = False
                  ) -> Tuple[np.ndarray, int]:
    """A client's update as ring elements (what it masks), and how many of its coordinates
    were clamped: per tensor of the layout, its weight times its delta clamped to [-B, B], then
    each tensor's weight times B (0 for a tensor it did not send), all in fixed point at the
    setup's scale, in its ring, rounded to nearest or (`toward_zero`: differential privacy's
    clipped updates) truncated. `weight_of`: tensor -> weight."""
    import torch

    clip_range = setup.clip_range
    parts, weights, clamped = [], [], 0
    for name, n in layout:
        d = deltas.get(name)
        if d is None:
            parts.append(np.zeros(n, dtype=np.float64))
            weights.append(0.0)
            continue
        w = float(weight_of[name])
        values = d.detach().to("cpu", torch.float64)
        clamped += int((values.abs() > clip_range).sum())
        parts.append(values.clamp(-clip_range, clip_range).mul(w).reshape(-1).numpy())
        weights.append(w * clip_range)
    parts.append(np.asarray(weights, dtype=np.float64))
    return encode(np.concatenate(parts), setup.scale, setup.ring_bits, toward_zero), clamped


def split_sum(total: np.ndarray, layout: Layout, scale: float, clip_range: float
              ) -> Tuple[Dict[str, np.ndarray], Dict[str, float]]:
    """The unmasked sum as (tensor -> sum of weight x delta, tensor -> sum of weights)."""
    values = decode(total, scale)
    sums, at = {}, 0
    for name, n in layout:
        sums[name] = values[at:at + n]
        at += n
    weights = {name: float(w) / clip_range for (name, _), w in zip(layout, values[at:])}
    return sums, weights


def prg(seed: bytes, length: int, ring_bits: int = 32) -> np.ndarray:
    """`length` pseudorandom elements of Z_2^ring_bits from a 32-byte seed (ChaCha20's
    keystream)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    width = ring_bits // 8
    stream = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(stream.update(b"\0" * (width * length)),
                         dtype=f"<u{width}").astype(RINGS[ring_bits][0])


def _kdf(shared: bytes, purpose: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=b"fedseq-secagg " + purpose).derive(shared)


def _agree(private_raw: bytes, public_raw: bytes, purpose: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    mine = X25519PrivateKey.from_private_bytes(private_raw)
    try:
        theirs = X25519PublicKey.from_public_bytes(public_raw)
        return _kdf(mine.exchange(theirs), purpose)
    except ValueError as exc:  # a low-order point: the agreement is all zeros
        raise SecAggError(f"unusable public key ({exc})") from exc


def _new_key() -> Tuple[bytes, bytes]:
    """(private, public) X25519 key, 32 raw bytes each."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    key = X25519PrivateKey.generate()
    private = key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
    return private, public_of(private)


def public_of(private_raw: bytes) -> bytes:
    """The X25519 public key of a raw private key."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(private_raw).public_key().public_bytes(
        ser.Encoding.Raw, ser.PublicFormat.Raw)


def pair_mask(private_raw: bytes, public_raw: bytes, length: int, ring_bits: int = 32
              ) -> np.ndarray:
    """The mask two neighbours share: the PRG of their agreed key."""
    return prg(_agree(private_raw, public_raw, b"mask"), length, ring_bits)


def _aad(round: int, sender: int, receiver: int) -> bytes:
    return struct.pack(">qII", round, sender, receiver)


def share_check(kind: str, round: int, owner: int, holder: int, value: int) -> bytes:
    """The check of one share (`kind` "b": of the self-mask seed, "s": of the mask key) that
    `owner` gave `holder` in secure round `round`: SHA-256 over all five. The owner sends it in
    stage 2; the holder checks what it decrypted against it; the coordinator checks what the
    holder reveals. A share is a random field element, so its check says nothing of it."""
    return hashlib.sha256(b"fedseq-secagg share " + kind.encode("ascii")
                          + struct.pack(">qII", round, owner, holder) + _bytes(value)).digest()


Checks = Dict[int, Tuple[bytes, bytes]]  # holder -> (check of its share of b, of s)


def _x(client: int) -> int:
    """A client's Shamir point: its index + 1 (never 0, where the secret is)."""
    return client + 1


def _bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def _as_keys(entry) -> Tuple[bytes, bytes]:
    if (not isinstance(entry, (tuple, list)) or len(entry) != 2 or not all(
            isinstance(k, bytes) and len(k) == KEY_BYTES for k in entry) or entry[0] == entry[1]):
        raise SecAggError("public keys must be two distinct 32-byte X25519 keys")
    return bytes(entry[0]), bytes(entry[1])


#: stage 1's keys as a client advertises them: (its channel key, or one per neighbour, its mask key)
Advertised = Tuple[Union[bytes, Dict[int, bytes]], bytes]


def _as_advertised(entry: object, neighbours: Sequence[int]) -> Advertised:
    """Stage 1's keys from a client: two distinct 32-byte keys, or (a paired setup) a channel
    key for each of its neighbours, exactly, and its mask key, all distinct."""
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], dict):
        channels, s = entry
        keys = list(channels.values()) + [s]
        if (set(channels) != set(neighbours) or not all(
                isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
                or len(set(keys)) != len(keys)):
            raise SecAggError("public keys must be a distinct 32-byte X25519 channel key for "
                              "each neighbour and a mask key")
        return {int(v): bytes(k) for v, k in channels.items()}, bytes(s)
    return _as_keys(entry)


def _opens(commitment: bytes):
    """Whether a reconstructed seed is the one a client committed to (SHA-256)."""
    return lambda secret: secret < 1 << 256 and hashlib.sha256(
        secret.to_bytes(32, "big")).digest() == commitment


def _pairs_with(public: bytes):
    """Whether a reconstructed mask key is the private key of a client's advertised one."""
    return lambda secret: secret < 1 << 256 and public_of(secret.to_bytes(32, "big")) == public


# -- a device's side -----------------------------------------------------------------------------
class SecAggClient:
    """One client's side of one secure round; fresh keys and seeds every round, never reused."""

    def __init__(self, me: int, setup: Setup):
        if me not in setup.graph:
            raise SecAggError(f"client {me} is not in secure round {setup.round}")
        self.me, self.setup = me, setup
        self.c_private, self.c_public = _new_key()
        #: a paired setup: neighbour -> (private, public) channel key of that pair alone
        self.channels = {v: _new_key() for v in setup.graph[me]} if setup.paired else {}
        self.s_private, self.s_public = _new_key()
        self.seed = secrets.token_bytes(KEY_BYTES)  # b: the self-mask's seed
        self.keys: Dict[int, Tuple[bytes, bytes]] = {}
        self.partners: List[int] = []  # neighbours whose shares arrived: the masks it adds
        self.held: Dict[int, Tuple[int, int]] = {}  # neighbour -> (share of b, share of s)
        self.disputed: Dict[int, str] = {}  # neighbour -> why its share to me is unusable
        self.revealed: Dict[int, str] = {}

    def advertise(self) -> Advertised:
        """Stage 1: (c, s) public keys; a paired setup: (neighbour -> its pair's c, s)."""
        if self.channels:
            return {v: public for v, (_, public) in self.channels.items()}, self.s_public
        return self.c_public, self.s_public

    def _channel(self, v: int) -> bytes:
        """The private key of this client's channel with neighbour v."""
        return self.channels[v][0] if self.channels else self.c_private

    def share_keys(self, keys: Mapping[int, Tuple[bytes, bytes]]
                   ) -> Tuple[Dict[int, bytes], bytes, Optional[Checks]]:
        """Stage 2: the neighbours' keys in, (receiver -> encrypted shares, SHA-256 of b, and
        receiver -> the checks of its shares where the setup is checked, else None) out."""
        mine = set(self.setup.graph[self.me])
        if set(keys) - mine:
            raise SecAggError(f"keys of clients {sorted(set(keys) - mine)[:5]} that are not "
                              f"client {self.me}'s neighbours")
        self.keys = {v: _as_keys(k) for v, k in keys.items()}
        if len({k for pair in self.keys.values() for k in pair}) != 2 * len(self.keys):
            raise SecAggError("two neighbours advertised the same public key")
        t = self.setup.threshold
        if len(self.keys) < t:
            raise SecAggError(f"{len(self.keys)} neighbours advertised keys, below the "
                              f"threshold {t}: the round cannot recover anyone")
        xs = [_x(v) for v in sorted(self.keys)]
        b_shares = shamir_share(int.from_bytes(self.seed, "big"), t, xs)
        s_shares = shamir_share(int.from_bytes(self.s_private, "big"), t, xs)
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        out = {}
        for v in sorted(self.keys):
            key = _agree(self._channel(v), self.keys[v][0], b"channel")
            nonce = secrets.token_bytes(NONCE_BYTES)
            plain = _PLAIN.pack(self.me, v, _bytes(b_shares[_x(v)]), _bytes(s_shares[_x(v)]))
            out[v] = nonce + ChaCha20Poly1305(key).encrypt(
                nonce, plain, _aad(self.setup.round, self.me, v))
        checks = {v: (share_check("b", self.setup.round, self.me, v, b_shares[_x(v)]),
                      share_check("s", self.setup.round, self.me, v, s_shares[_x(v)]))
                  for v in sorted(self.keys)} if self.setup.checked else None
        return out, hashlib.sha256(self.seed).digest(), checks

    def masked_input(self, elements: np.ndarray, shares: Mapping[int, bytes],
                     checks: Optional[Checks] = None) -> np.ndarray:
        """Stage 3: the encoded update (ring elements), the shares addressed to this client and
        (a checked setup) their owners' checks in, the masked input out. In a checked setup a
        share that does not decrypt, names other clients or fails its check is disputed (never
        revealed) and its owner stays a partner: the masks do not depend on the shares."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        s = self.setup
        if elements.shape != (s.length,) or elements.dtype != s.dtype:
            raise SecAggError(f"an encoded update must be {s.length} elements of the "
                              f"{s.ring_bits}-bit ring")
        for v, blob in sorted(shares.items()):
            if v not in self.keys or not isinstance(blob, bytes) or len(blob) != CIPHER_BYTES:
                raise SecAggError(f"a share from {v}, not a neighbour that advertised keys, or "
                                  f"not {CIPHER_BYTES} bytes")
            key = _agree(self._channel(v), self.keys[v][0], b"channel")
            try:
                plain = ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:],
                                                      _aad(self.setup.round, v, self.me))
                sender, receiver, b_share, s_share = _PLAIN.unpack(plain)
                b_int, s_int = int.from_bytes(b_share, "big"), int.from_bytes(s_share, "big")
                if (sender, receiver) != (v, self.me) or b_int >= PRIME or s_int >= PRIME:
                    raise SecAggError(f"the share from {v} names other clients or is out of "
                                      "range")
                if self.setup.checked and checks is not None and v in checks and checks[v] != (
                        share_check("b", s.round, v, self.me, b_int),
                        share_check("s", s.round, v, self.me, s_int)):
                    raise SecAggError(f"the share from {v} fails its check")
            except (InvalidTag, SecAggError) as exc:
                why = str(exc) if isinstance(exc, SecAggError) else \
                    f"the share from {v} does not decrypt"
                if not self.setup.checked:
                    raise SecAggError(why) from None
                self.disputed[v] = why
                continue
            self.held[v] = (b_int, s_int)
        partners = set(self.held) | set(self.disputed)
        if len(partners) < self.setup.threshold:
            raise SecAggError(f"shares from {len(partners)} neighbours, below the threshold "
                              f"{self.setup.threshold}")
        self.partners = sorted(partners)
        y = elements + prg(self.seed, s.length, s.ring_bits)
        for v in self.partners:
            mask = pair_mask(self.s_private, self.keys[v][1], s.length, s.ring_bits)
            y = y + mask if self.me < v else y - mask
        return y

    def unmask(self, survivors: Sequence[int], dropped: Sequence[int]) -> Dict[int, Tuple[str, int]]:
        """Stage 4: who sent a masked input and who dropped after sharing in; per neighbour,
        the share of b (survived) or of s (dropped) out, never both for one neighbour."""
        alive, gone = set(survivors), set(dropped)
        if alive & gone or (alive | gone) - set(self.partners) - {self.me}:
            raise SecAggError("survivors and dropped must be disjoint sets of this client's "
                              "partners")
        if self.me not in alive:
            raise SecAggError(f"client {self.me} is told it did not survive")
        if len(alive) < self.setup.threshold:  # itself among them
            raise SecAggError(f"{len(alive)} surviving neighbours: too few to unmask safely")
        out = {self.me: (OWN, int.from_bytes(self.seed, "big"))} if self.setup.opens else {}
        for v, kind in [(v, "b") for v in alive - {self.me}] + [(v, "s") for v in gone]:
            if v in self.disputed:  # (a paired setup: the pair's key shows who lied)
                out[v] = (DISPUTED, int.from_bytes(self.channels[v][0], "big")
                          if self.channels else 0)
                continue
            if self.revealed.setdefault(v, kind) != kind:
                raise SecAggError(f"both secrets of client {v} asked for")
            b_share, s_share = self.held[v]
            out[v] = (kind, b_share if kind == "b" else s_share)
        return out


# -- the coordinator's side ----------------------------------------------------------------------
@dataclass
class SecAggServer:
    """The coordinator's side of one secure round: it relays, sums and unmasks, and learns the
    sum of the masked inputs it accepted and nothing else of any one client's."""

    setup: Setup
    keys: Dict[int, Advertised] = field(default_factory=dict)  # stage 1
    commitments: Dict[int, bytes] = field(default_factory=dict)  # stage 2: SHA-256 of b
    #: stage 2, a checked setup: owner -> holder -> (check of its share of b, of s); an owner
    #: that sent none (an older device) is missing
    checks: Dict[int, Checks] = field(default_factory=dict)
    routed: Dict[int, Dict[int, bytes]] = field(default_factory=dict)  # receiver -> sender -> blob
    total: Optional[np.ndarray] = None
    masked: List[int] = field(default_factory=list)  # stage 3: whose masked input is in total
    dropped: Dict[int, str] = field(default_factory=dict)  # client -> at which stage and why
    #: client -> a wrong share it sent in stage 4 (its own masked input still counts)
    blamed: Dict[int, str] = field(default_factory=dict)
    #: stage 4 of an `opens` setup: survivor -> its own seed b, as it opened it (and its
    #: commitment bears out)
    opened: Dict[int, int] = field(default_factory=dict)

    def drop(self, client: int, why: str) -> None:
        """Count `client` out of the round's sum, with the first reason given for it."""
        self.dropped.setdefault(client, why)

    def advertised(self, keys: Mapping[int, object]) -> Dict[int, Dict[int, Tuple[bytes, bytes]]]:
        """Stage 1's messages in (a client that sent none has dropped); per client, its
        neighbours' keys to send it."""
        for c, entry in sorted(keys.items()):
            if c not in self.setup.graph:
                continue
            try:
                self.keys[c] = _as_advertised(entry, self.setup.graph[c])
            except SecAggError as exc:
                self.drop(c, f"advertise: {exc}")
        seen: Dict[bytes, int] = {}
        for c, (channel, s) in sorted(self.keys.items()):
            for k in [*(channel.values() if isinstance(channel, dict) else [channel]), s]:
                if k in seen:
                    self.drop(c, f"advertise: a public key client {seen[k]} advertised too")
                seen.setdefault(k, c)
        for c in self.setup.clients:
            if c not in self.keys:
                self.drop(c, "advertise: no public keys")
        self.keys = {c: k for c, k in self.keys.items() if c not in self.dropped}
        return {c: {v: (self.channel_key(v, c), self.keys[v][1])
                    for v in self.setup.graph[c] if v in self.keys} for c in self.keys}

    def channel_key(self, owner: int, peer: int) -> bytes:
        """The public key of `owner`'s channel with `peer`, as `owner` advertised it."""
        channel = self.keys[owner][0]
        return channel[peer] if isinstance(channel, dict) else channel

    def shared(self, sent: Mapping[int, object]) -> Dict[int, Dict[int, bytes]]:
        """Stage 2's messages in ((receiver -> blob, commitment, receiver -> checks or None) per
        client); per client, the blobs addressed to it by neighbours that shared, to send it
        (with `checks_for` it)."""
        for c in sorted(self.keys):
            entry = sent.get(c)
            if c in self.dropped:
                continue
            if entry is None:
                self.drop(c, "share keys: no shares")
                continue
            try:
                if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                    raise SecAggError("expected (shares, commitment, checks)")
                blobs: Any = entry[0]
                commitment: Any = entry[1]
                checks: Any = entry[2] if len(entry) == 3 else None
                wanted = {v for v in self.setup.graph[c] if v in self.keys}
                if (not isinstance(blobs, dict) or set(blobs) != wanted or not all(
                        isinstance(b, bytes) and len(b) == CIPHER_BYTES for b in blobs.values())
                        or not isinstance(commitment, bytes) or len(commitment) != 32):
                    raise SecAggError(f"expected {CIPHER_BYTES}-byte shares for exactly its "
                                      "neighbours that advertised keys, and a 32-byte commitment")
                if checks is not None and (not self.setup.checked or not isinstance(
                        checks, dict) or set(checks) != wanted or not all(
                        isinstance(pair, tuple) and len(pair) == 2 and all(
                            isinstance(h, bytes) and len(h) == 32 for h in pair)
                        for pair in checks.values())):
                    raise SecAggError("expected two 32-byte checks for each share it sent")
            except (TypeError, ValueError, SecAggError) as exc:
                self.drop(c, f"share keys: {exc}")
                continue
            self.commitments[c] = commitment
            if checks is not None:
                self.checks[c] = dict(checks)
            for v, blob in blobs.items():
                self.routed.setdefault(v, {})[c] = blob
        sharers = set(self.commitments)
        return {c: {v: b for v, b in self.routed.get(c, {}).items() if v in sharers}
                for c in sorted(sharers)}

    def checks_for(self, holder: int) -> Optional[Checks]:
        """The checks of the shares addressed to `holder` (sender -> its two checks), to relay
        with them; None where `holder` sent no checks itself (a device that reads none)."""
        if holder not in self.checks:
            return None
        return {v: c[holder] for v, c in sorted(self.checks.items()) if holder in c}

    def add_masked(self, client: int, y: object) -> None:
        """One stage-3 message in: its masked input joins the sum (junk drops the client)."""
        if client not in self.commitments or client in self.dropped or client in self.masked:
            self.drop(client, "masked input: not expected from it")
            return
        if (not isinstance(y, np.ndarray) or y.dtype != self.setup.dtype
                or y.shape != (self.setup.length,)):
            self.drop(client, f"masked input: not {self.setup.length} elements of the "
                              f"{self.setup.ring_bits}-bit ring")
            return
        self.total = y.copy() if self.total is None else self.total + y
        self.masked.append(client)

    def unmask_requests(self) -> Dict[int, Tuple[List[int], List[int]]]:
        """Per client that sent a masked input: (its partners that did too, those that shared
        keys and sent none), which stage 4 asks it to unmask."""
        alive = set(self.masked)
        out = {}
        for c in self.masked:
            partners = [v for v in self.setup.graph[c] if v in self.commitments]
            out[c] = ([v for v in partners if v in alive] + [c],
                      [v for v in partners if v not in alive])
        return out

    def unmasked(self, shares: Mapping[int, object]) -> np.ndarray:
        """Stage 4's messages in (neighbour -> (kind, share) per client); the sum of the masked
        inputs without their masks. SecAggError where some secret cannot be recovered (fewer
        than t valid shares): the round fails, and its sum is never known."""
        if self.total is None:
            raise SecAggError("no masked input arrived")
        points = self._valid_points(shares)
        total = self.total.copy()
        t, n, bits = self.setup.threshold, self.setup.length, self.setup.ring_bits
        for c in self.masked:
            b = self.opened.get(c)
            if b is None:
                b = self._recover(c, points["b"].get(c, {}), _opens(self.commitments[c]), "seed")
            if b is None:
                raise SecAggError(f"client {c}'s self-mask: {_short(points['b'].get(c, {}), t)}; "
                                  "the round's sum cannot be unmasked")
            total = total - prg(b.to_bytes(32, "big"), n, bits)
        survived = set(self.masked)
        for v in sorted(set(self.commitments) - survived):
            self.drop(v, "masked input: none came (its masks are removed with its neighbours' "
                         "shares)")
            s = self._recover(v, points["s"].get(v, {}), _pairs_with(self.keys[v][1]),
                              "mask key")
            if s is None:
                raise SecAggError(f"client {v} dropped after sharing: its mask key: "
                                  f"{_short(points['s'].get(v, {}), t)}; the round's sum cannot "
                                  "be unmasked")
            for u in self.setup.graph[v]:
                if u in survived:  # u masked with v: both shared, and the graph is symmetric
                    mask = pair_mask(s.to_bytes(32, "big"), self.keys[u][1], n, bits)
                    # u added +mask where u < v, -mask otherwise: take it back out
                    total = total - mask if u < v else total + mask
        return total

    def _valid_points(self, shares: Mapping[int, object]) -> Dict[str, Dict[int, Dict[int, int]]]:
        """The stage 4 shares that count, as points: kind ("b", "s") -> owner -> x -> share. A
        holder that answers other than it was asked is blamed and its answer left out; one that
        sends a share failing its owner's check is blamed and that share left out; a disputed
        share proves nobody bad."""
        asked = self.unmask_requests()
        points: Dict[str, Dict[int, Dict[int, int]]] = {"b": {}, "s": {}}  # kind -> owner -> x
        for c, got in sorted(shares.items()):
            if c not in asked:
                continue
            alive, gone = asked[c]
            want = {v: "b" for v in alive if v != c}
            want.update({v: "s" for v in gone})
            if self.setup.opens and isinstance(got, dict) and c in got:
                got = dict(got)
                self._open_own(c, got.pop(c))
            try:
                if not isinstance(got, dict) or set(got) != set(want):
                    raise SecAggError("shares for other clients than asked")
                for v, entry in got.items():
                    kind, value = entry
                    if kind not in (want[v], DISPUTED) or not isinstance(value, int) or \
                            not 0 <= value < PRIME:
                        raise SecAggError(f"a share of {v} of the wrong kind or out of range")
            except (TypeError, ValueError, SecAggError) as exc:
                self.blamed.setdefault(c, f"unmask: {exc}")
                continue
            for v, (kind, value) in got.items():
                if kind == DISPUTED:  # a paired setup: the pair's key shows who lied
                    share = self._judged(c, v, value, want[v])
                    if share is not None:
                        points[want[v]].setdefault(v, {})[_x(c)] = share
                    continue
                check = self.checks.get(v, {}).get(c)
                if check is not None and share_check(
                        kind, self.setup.round, v, c, value) != check[0 if kind == "b" else 1]:
                    # c had the check in stage 3 and did not dispute: the share is its own junk
                    self.blamed.setdefault(c, f"unmask: its share of client {v}'s "
                                              f"{'seed' if kind == 'b' else 'mask key'} fails "
                                              "its owner's check")
                    continue
                points[kind].setdefault(v, {})[_x(c)] = value
        return points

    def _judged(self, holder: int, owner: int, key: int, kind: str) -> Optional[int]:
        """A dispute of `owner`'s share by `holder`: with a paired setup, `key` is the private
        key of their channel. The share is decrypted with it: one that decrypts, names them and
        passes its owner's check proves the dispute false (the holder is blamed, and its share
        counts); one that does not proves the owner's share junk (the owner is blamed). A key
        that is not the holder's advertised one, or none from a holder that advertised paired
        keys, blames the holder. Without paired keys (an older device): nobody is proven bad."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        if not isinstance(self.keys.get(holder, (b"",))[0], dict):
            return None
        if not 0 < key < 1 << 256 or public_of(key.to_bytes(KEY_BYTES, "big")) != \
                self.channel_key(holder, owner):
            self.blamed.setdefault(holder, f"unmask: its dispute of client {owner}'s share "
                                           "does not reveal the key of their channel")
            return None
        blob = self.routed.get(holder, {}).get(owner)
        if blob is None:
            return None
        try:
            channel = _agree(key.to_bytes(KEY_BYTES, "big"), self.channel_key(owner, holder),
                             b"channel")
            plain = ChaCha20Poly1305(channel).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:],
                                                      _aad(self.setup.round, owner, holder))
            sender, receiver, b_raw, s_raw = _PLAIN.unpack(plain)
            b, s = int.from_bytes(b_raw, "big"), int.from_bytes(s_raw, "big")
            check = self.checks.get(owner, {}).get(holder)
            sound = ((sender, receiver) == (owner, holder) and b < PRIME and s < PRIME and (
                check is None or check == (share_check("b", self.setup.round, owner, holder, b),
                                           share_check("s", self.setup.round, owner, holder, s))))
        except (InvalidTag, SecAggError, struct.error):
            sound = False
        if not sound:
            self.blamed.setdefault(owner, f"share keys: its share to client {holder} does not "
                                          "decrypt or fails its own check (shown with their "
                                          "channel's key)")
            return None
        self.blamed.setdefault(holder, f"unmask: it disputed client {owner}'s share, which "
                                       "decrypts and passes its check")
        return b if kind == "b" else s

    def _open_own(self, c: int, entry: object) -> None:
        """A survivor's own seed, opened in stage 4: kept where its commitment bears it out;
        a survivor that opens another is blamed (its self-mask is then recovered from shares,
        if t are valid)."""
        if (isinstance(entry, tuple) and len(entry) == 2 and entry[0] == OWN
                and isinstance(entry[1], int) and 0 <= entry[1] < PRIME
                and _opens(self.commitments[c])(entry[1])):
            self.opened[c] = entry[1]
        else:
            self.blamed.setdefault(c, "unmask: the seed it opened is not the one it committed to")

    def _recover(self, owner: int, points: Dict[int, int], valid, what: str) -> Optional[int]:
        """`owner`'s secret (`what`) from the revealed shares. Checked shares (each passed its
        owner's check): the first t, at once; where they do not open the owner's commitment,
        the owner's own shares contradict each other, and it is blamed. Unchecked (an older
        device): subsets tried, those without a blamed holder's share first; holders whose
        share lies off the recovered polynomial are blamed."""
        t = self.setup.threshold
        if owner in self.checks:
            if len(points) < t:
                return None
            first = shamir_reconstruct(dict(sorted(points.items())[:t]))
            if valid(first):
                return first
            self.blamed.setdefault(owner, f"unmask: its checked shares of its {what} do not "
                                          "open its commitment")
            return None
        found, wrong = robust_reconstruct(points, t, valid, suspect={_x(c) for c in self.blamed})
        for x in wrong:
            self.blamed.setdefault(x - 1, f"unmask: a wrong share of client {owner}'s {what}")
        return found


def _short(points: Mapping[int, int], t: int) -> str:
    """Why a secret was not recovered from `points`, in words."""
    if len(points) < t:
        return f"{len(points)} valid shares, {t} needed"
    return f"no {t} of its {len(points)} shares recover it (junk among them)"


# -- on the wire (protocol v9: Step.secagg and SecAggMessage) ------------------------------------
def setup_to_dict(setup: Setup, layout: Layout, unweighted: bool) -> Dict[str, Any]:
    """A round's setup as the train step carries it to the devices (JSON)."""
    return {"round": setup.round, "graph": {str(c): list(v) for c, v in setup.graph.items()},
            "threshold": setup.threshold, "length": setup.length, "scale": setup.scale,
            "clip_range": setup.clip_range, "ring_bits": setup.ring_bits,
            "layout": [[k, n] for k, n in layout], "unweighted": unweighted,
            **({"checked": True} if setup.checked else {}),
            **({"opens": True} if setup.opens else {}),
            **({"paired": True} if setup.paired else {})}


def setup_from_dict(raw: object) -> Tuple[Setup, Layout, bool]:
    """A step's secure setup back (Setup, layout, whether every update weighs 1); SecAggError in
    one line where it is malformed."""
    try:
        assert isinstance(raw, dict)
        graph = {int(c): [int(v) for v in vs] for c, vs in raw["graph"].items()}
        layout = [(str(k), int(n)) for k, n in raw["layout"]]
        setup = Setup(round=int(raw["round"]), graph=graph, threshold=int(raw["threshold"]),
                      length=int(raw["length"]), scale=float(raw["scale"]),
                      clip_range=float(raw["clip_range"]), ring_bits=int(raw["ring_bits"]),
                      checked=raw.get("checked", False), opens=raw.get("opens", False),
                      paired=raw.get("paired", False))
        unweighted = raw["unweighted"]
        assert isinstance(unweighted, bool) and isinstance(setup.checked, bool)
        assert isinstance(setup.opens, bool) and isinstance(setup.paired, bool)
        assert all(c not in vs and all(v in graph and c in graph[v] for v in vs)
                   for c, vs in graph.items()), "the graph is not symmetric"
        assert setup.threshold >= 1 and setup.scale > 0 and setup.clip_range > 0
        assert setup.ring_bits in RINGS, f"a {setup.ring_bits}-bit ring"
        assert setup.length == vector_length(layout) and all(n > 0 for _, n in layout)
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SecAggError(f"a malformed secure-aggregation setup ({exc or 'a wrong field'})"
                          ) from None
    return setup, layout, unweighted


def to_text(blob: bytes) -> str:
    """Bytes as the stage messages carry them (base64)."""
    return base64.b64encode(blob).decode("ascii")


def from_text(text: object, size: int) -> bytes:
    """Base64 text back to exactly `size` bytes; SecAggError otherwise."""
    try:
        if not isinstance(text, str) or len(text) > 4 * size:
            raise ValueError
        blob = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise SecAggError(f"expected {size} bytes in base64") from None
    if len(blob) != size:
        raise SecAggError(f"expected {size} bytes in base64, got {len(blob)}")
    return blob


def keys_to_wire(keys: Advertised) -> List[Any]:
    """Stage 1's keys as they travel: [c, s], or [{neighbour: c}, s] (paired)."""
    channel, s = keys
    return [{str(v): to_text(k) for v, k in channel.items()} if isinstance(channel, dict)
            else to_text(channel), to_text(s)]


def keys_from_wire(entry: object) -> Advertised:
    """Stage 1's keys from their wire form: (c, s), or ({neighbour: c}, s) (paired)."""
    if not isinstance(entry, list) or len(entry) != 2:
        raise SecAggError("public keys: expected two base64 keys")
    if isinstance(entry[0], dict):
        try:
            channels = {int(v): from_text(k, KEY_BYTES) for v, k in entry[0].items()}
        except ValueError:
            raise SecAggError("public keys: a neighbour that is not a client") from None
        return channels, from_text(entry[1], KEY_BYTES)
    return from_text(entry[0], KEY_BYTES), from_text(entry[1], KEY_BYTES)


def shares_to_wire(blobs: Mapping[int, bytes], commitment: bytes,
                   checks: Optional[Checks]) -> Dict[str, Any]:
    """Stage 2's answer as it travels (checks only in a checked setup)."""
    return {"to": {str(v): to_text(b) for v, b in blobs.items()}, "commit": to_text(commitment),
            **({"checks": checks_to_wire(checks)} if checks is not None else {})}


def shares_from_wire(entry: object) -> Tuple[Dict[int, bytes], bytes, Optional[Checks]]:
    """Stage 2's (receiver -> encrypted share, commitment, receiver -> checks or None) from its
    wire form."""
    if not isinstance(entry, dict) or set(entry) - {"checks"} != {"to", "commit"} or \
            not isinstance(entry["to"], dict):
        raise SecAggError("shares: expected {\"to\": {receiver: share}, \"commit\": ..., "
                          "\"checks\": {receiver: [check, check]}}")
    try:
        return ({int(v): from_text(b, CIPHER_BYTES) for v, b in entry["to"].items()},
                from_text(entry["commit"], 32),
                checks_from_wire(entry["checks"]) if "checks" in entry else None)
    except ValueError:
        raise SecAggError("shares: a receiver that is not a client") from None


def checks_to_wire(checks: Checks) -> Dict[str, List[str]]:
    """A holder's checks of the shares it received as JSON: owner -> [check of the b share, check of
    the s share], base64."""
    return {str(v): [to_text(b), to_text(s)] for v, (b, s) in checks.items()}


def checks_from_wire(entry: object) -> Checks:
    """client -> (check of a share of b, of s) from its wire form; SecAggError otherwise."""
    if not isinstance(entry, dict) or not all(
            isinstance(pair, list) and len(pair) == 2 for pair in entry.values()):
        raise SecAggError("checks: expected {client: [check of b, check of s]}")
    try:
        return {int(v): (from_text(pair[0], 32), from_text(pair[1], 32))
                for v, pair in entry.items()}
    except ValueError:
        raise SecAggError("checks: a client that is not a client id") from None


def relay_to_wire(blobs: Mapping[int, bytes], checks: Optional[Checks]) -> Dict[str, Any]:
    """Stage 3's input for one holder: sender -> its share, or (a holder that reads checks)
    sender -> [its share, check of b, check of s] (a sender without checks: [its share])."""
    if checks is None:
        return {str(v): to_text(b) for v, b in blobs.items()}
    return {str(v): [to_text(b), *([to_text(h) for h in checks[v]] if v in checks else [])]
            for v, b in blobs.items()}


def relay_from_wire(entry: object) -> Tuple[Dict[int, bytes], Checks]:
    """Stage 3's input back: (sender -> share, sender -> its checks where it sent them)."""
    if not isinstance(entry, dict):
        raise SecAggError("shares: expected {sender: share}")
    blobs, checks = {}, {}
    try:
        for v, item in entry.items():
            if isinstance(item, list):
                if len(item) not in (1, 3):
                    raise ValueError
                if len(item) == 3:
                    checks[int(v)] = (from_text(item[1], 32), from_text(item[2], 32))
                item = item[0]
            blobs[int(v)] = from_text(item, CIPHER_BYTES)
    except (ValueError, TypeError):
        raise SecAggError("shares: expected {sender: share or [share, check, check]}") from None
    return blobs, checks


def answer_from_wire(entry: object) -> Dict[int, Tuple[str, int]]:
    """Stage 4's (neighbour -> (kind, share)) from its wire form."""
    if not isinstance(entry, dict):
        raise SecAggError("unmask: expected {neighbour: [kind, share]}")
    out = {}
    try:
        for v, pair in entry.items():
            kind, value = pair
            if kind == DISPUTED:  # its pair's channel key in a paired setup, else nothing
                out[int(v)] = (kind, int.from_bytes(from_text(value, KEY_BYTES), "big")
                               if value != "" else 0)
                continue
            if kind not in ("b", "s", OWN):
                raise ValueError
            out[int(v)] = (kind, int.from_bytes(from_text(value, SHARE_BYTES), "big"))
    except (TypeError, ValueError, SecAggError):
        raise SecAggError("unmask: expected {neighbour: [\"b\" or \"s\", share] or "
                          "[\"x\", \"\" or its channel's key]}") from None
    return out


def answer_to_wire(answer: Mapping[int, Tuple[str, int]]) -> Dict[str, List[str]]:
    """A holder's unmask answer as JSON: owner -> [kind, the share in base64], the share empty where
    the holder disputes it."""
    return {str(v): [kind, ("" if not value else to_text(value.to_bytes(KEY_BYTES, "big")))
                     if kind == DISPUTED else to_text(_bytes(value))]
            for v, (kind, value) in answer.items()}
