"""Fixed-point encoding on ``Z_n`` for the weighted sum, with its correctness conditions.

A real ``x`` (a Python/NumPy float64) becomes the signed integer ``round(x * 10^d)`` computed
*exactly* - ``x.as_integer_ratio()`` and integer division, ties to even - never through a
lower-precision float; negatives live in ``Z_n`` as ``n - |v|``.

The weight ``n_{s,a} / n_a`` is applied exactly through ``L = lcm(1..N_max)``: the silo
multiplies by ``r_a n_{s,a} M`` (``M = L S``, :attr:`WeightingEncoding.multiplier`) and the
server's encrypted ``(r_a n_a)^{-1}``, so the plaintext gains the *integer* factor
``n_{s,a} M / n_a`` - an integer only because ``n_a`` divides ``L``, i.e. only if
``1 <= n_a <= N_max``. A subject with ``n_a > N_max`` would silently decode to garbage, so it
is refused (:class:`~silodp.crypto.errors.SubjectBoundError`).

Noise lives on the finest grid, ``1 / (M 10^d)``: silo ``s`` adds the integer ``round(y_s)``
with ``y_s ~ N(0, a^2)``, ``a`` the rational :meth:`WeightingEncoding.silo_noise_scale`
(``a >= σ Δ M 10^d / sqrt(S)``). The silo draws ``round(y_s)`` *exactly*, as a sample of the
rounded continuous Gaussian (:func:`silodp.privacy.noise.rounded_gaussian`), and hands the
integers over already encoded (:meth:`WeightingEncoding.check_encoded_noise`); no float noise
is ever rounded. Decryption yields

    D = S X + sum_s round(y_s) mod n,   X = sum_{s,a} (L n_{s,a}/n_a) e_{s,a}  (an integer),

and decoding lifts ``D`` to ``(-n/2, n/2]`` and divides by ``M 10^d``.

Why the factor ``S``: it makes the rounded noise an exact post-processing of the Gaussian
mechanism, so ε needs no allowance for rounding. The ``y_s`` are i.i.d. ``N(0, a^2)``; with
``G = sum_s y_s ~ N(0, S a^2)`` and ``u_s = y_s - G/S`` (independent of ``G``, and of the data),
``sum_s round(y_s) = g_u(G)`` for ``g_u(x) = sum_s round(x/S + u_s)``. Since
``g_u(x + S m) = g_u(x) + S m`` for every integer ``m``, ``D = g_u(S X + G)``: a function,
with data-independent randomness ``u``, of ``S X + G``. Divided by ``M 10^d``, ``S X + G`` is
the weighted sum of the rounded clipped deltas plus ``N(0, S a^2 / (M 10^d)^2)`` noise per
coordinate, of std at least ``σ Δ``: the Gaussian mechanism the accountant charges (a larger
std is that mechanism plus independent noise, again a post-processing). Each silo only has
to sample ``round(y_s)`` exactly (its law is all that enters ``D``); without the factor ``S``
(``D = X + sum_s round(y_s)``), ``D`` is no such function.

With ``weight_bits = k`` (fixed-point weights, :mod:`silodp.crypto.bfv.fixed_weights`), ``L``
is ``2^k`` and the weight ``n_{s,a}/n_a`` enters as ``n_{s,a} floor(2^k/n_a)``, never more: a
subject's weights still sum to at most one, and the weighted sum is lower by at most
``A n_max delta_bound / 2^k`` (:attr:`WeightingEncoding.max_abs_error`). The rest (the noise,
the factor ``S``, the bound on ``|D|``) is unchanged.

That is exact if the true ``|D| < n / 2``. With ``|delta| <= delta_bound`` and
``|noise| <= noise_bound`` per coordinate, ``A`` subjects (the per-subject weights sum to at
most one over silos) and ``S`` silos,

    |D| <= M A E_delta + S E_noise,   E_delta = ceil(delta_bound 10^d),
                                       E_noise = ceil(noise_bound M 10^d),

and :class:`WeightingEncoding` refuses, at set-up, parameters where ``2 |D|_max >= n``
(:class:`~silodp.crypto.errors.EncodingOverflowError`); encoding a value beyond its declared
bound raises :class:`~silodp.crypto.errors.ValueOutOfRangeError`. The decoded value differs
from the real weighted sum only by the rounding of each encoded value:
``|error| <= A / (2 10^d) + S / (2 M 10^d)`` (plus the final float64 rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction

import numpy as np

from silodp.crypto.errors import EncodingOverflowError, SubjectBoundError, ValueOutOfRangeError

__all__ = [
    "MAX_N_MAX",
    "check_bound",
    "FixedPointCodec",
    "WeightingEncoding",
    "lcm_upto",
    "precision_digits",
]


def check_bound(name: str, value: object) -> None:
    """Refuses a public bound that is not a finite real number ``>= 0`` (bools included)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"Expected {name}={value!r} to be a finite number >= 0.")


MAX_N_MAX = 1_000_000
_MAX_DIGITS = 40


def lcm_upto(n_max: int) -> int:
    """``lcm(1, 2, ..., n_max)``: the product of the largest prime powers ``<= n_max``."""
    if isinstance(n_max, bool) or not isinstance(n_max, int) or not 1 <= n_max <= MAX_N_MAX:
        raise ValueError(f"Expected n_max={n_max!r} to be an int in [1, {MAX_N_MAX}].")
    sieve = bytearray([1]) * (n_max + 1)
    sieve[0:2] = b"\x00\x00"
    for i in range(2, math.isqrt(n_max) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n_max + 1, i)))
    result = 1
    for p in range(2, n_max + 1):
        if sieve[p]:
            power = p
            while power * p <= n_max:
                power *= p
            result *= power
    return result


def precision_digits(precision: float) -> int:
    """``d`` for a precision ``10^-d`` (e.g. ``1e-10 -> 10``); other values are refused."""
    if isinstance(precision, bool) or not isinstance(precision, int | float):
        raise ValueError(f"Expected precision={precision!r} to be a number like 1e-10.")
    try:
        dec = Decimal(repr(float(precision))).normalize()
    except InvalidOperation as err:  # pragma: no cover - repr of a float always parses
        raise ValueError(f"Expected precision={precision!r} to be a number.") from err
    sign, digits, exponent = dec.as_tuple()
    if sign or digits != (1,) or not isinstance(exponent, int) or not -_MAX_DIGITS <= exponent <= 0:
        raise ValueError(
            f"Expected precision={precision!r} to be a power of ten 10^-d, 0 <= d <= {_MAX_DIGITS}."
        )
    return -exponent


def _round_scaled(x: float, scale: int) -> int:
    """``round(x * scale)`` exactly (ties to even) for a finite float ``x``."""
    num, den = x.as_integer_ratio()
    q, r = divmod(num * scale, den)
    twice = 2 * r
    if twice > den or (twice == den and q & 1):
        q += 1
    return q


#: :func:`round_scaled_array` handles ``10^d`` with ``5^d < 2^31`` and results below 2^62
_ARRAY_MAX_DIGITS = 13
_ARRAY_MAX_BITS = 62


def round_scaled_array(x: np.ndarray, digits: int) -> np.ndarray:
    """``round(x * 10^digits)`` exactly (ties to even) for every finite float64 of ``x``, as
    int64, vectorised: ``x = m 2^e`` exactly, ``m 5^d`` is formed in two 26-bit halves (no
    overflow) and shifted by ``e + d`` with the remainder compared to one half. Requires
    ``digits <= 13`` and ``|x| 10^digits < 2^62`` (else ValueError); equal to
    :func:`_round_scaled` value by value."""
    if not 0 <= digits <= _ARRAY_MAX_DIGITS:
        raise ValueError(f"Expected digits={digits} in [0, {_ARRAY_MAX_DIGITS}].")
    arr = np.asarray(x, dtype=np.float64)
    if arr.size and float(np.abs(arr).max()) * 10.0**digits >= 2.0**_ARRAY_MAX_BITS / 2:
        raise ValueError(f"Expected |x| * 10^{digits} below 2^{_ARRAY_MAX_BITS - 1}.")
    frac, exp = np.frexp(np.abs(arr))
    mant = np.ldexp(frac, 53).astype(np.int64)  # exact: |x| = mant * 2^(exp - 53)
    shift = (53 - exp.astype(np.int64)) - digits  # |x| 10^d = mant 5^d / 2^shift
    five = np.int64(5**digits)
    hi = (mant >> 26) * five  # < 2^27 * 2^31
    lo = (mant & ((1 << 26) - 1)) * five  # < 2^57
    hi = hi + (lo >> 26)
    lo = lo & ((1 << 26) - 1)  # P = hi 2^26 + lo
    out = np.zeros(arr.shape, dtype=np.int64)
    # shift <= 0: an exact integer P << -shift (fits, as the result is below 2^61)
    neg = shift <= 0
    if np.any(neg):
        up = -shift[neg]
        out[neg] = (hi[neg] << (26 + up)) + (lo[neg] << up)
    # 0 < shift < 26: quotient (hi << (26 - shift)) + (lo >> shift), remainder from lo
    mid = (shift > 0) & (shift < 26)
    if np.any(mid):
        k = shift[mid]
        q = (hi[mid] << (26 - k)) + (lo[mid] >> k)
        rem = lo[mid] & ((np.int64(1) << k) - 1)
        half = np.int64(1) << (k - 1)
        q += (rem > half) | ((rem == half) & ((q & 1) == 1))
        out[mid] = q
    # shift >= 26: quotient hi >> (shift - 26); remainder (hi mod 2^(shift-26), lo)
    big = shift >= 26
    if np.any(big):
        k = shift[big] - 26
        h, low = hi[big], lo[big]
        small = k < 62
        kk = np.where(small, k, 0)
        q = np.where(small, h >> kk, 0)
        rem_hi = np.where(small, h - (q << kk), h)
        half_hi = np.where(kk > 0, np.int64(1) << np.maximum(kk - 1, 0), 0)
        # remainder vs half: k == 0 compares lo with 2^25; k >= 1 compares (rem_hi, lo) with
        # (2^(k-1), 0); k >= 62 rounds to 0 (P < 2^85 <= 2^(shift-1))
        above = np.where(
            k == 0, low > (1 << 25), (rem_hi > half_hi) | ((rem_hi == half_hi) & (low > 0))
        )
        tie = np.where(k == 0, low == (1 << 25), (rem_hi == half_hi) & (low == 0))
        q = q + (small & (above | (tie & ((q & 1) == 1))))
        out[big] = q
    return np.where(arr < 0, -out, out)


def _as_float64(values: object, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "fiu" or (arr.dtype.kind == "f" and arr.dtype.itemsize > 8):
        raise ValueError(f"Expected {name} to hold float64 (or narrower) numbers, got {arr.dtype}.")
    if arr.dtype.kind in "iu" and arr.size and int(np.abs(arr).max()) > 2**53:
        raise ValueError(f"Integer {name} above 2**53 cannot be converted exactly.")
    out = arr.astype(np.float64)  # exact: widening, or integers below 2**53
    if not np.all(np.isfinite(out)):
        raise ValueError(f"Expected finite {name}; got NaN or inf.")
    return out


@dataclass(frozen=True)
class FixedPointCodec:
    """Signed fixed point with ``frac_digits`` decimal digits (scale ``10^frac_digits``)."""

    frac_digits: int = 10

    def __post_init__(self) -> None:
        d = self.frac_digits
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= _MAX_DIGITS:
            raise ValueError(f"Expected frac_digits={d!r} in [0, {_MAX_DIGITS}].")

    @property
    def scale(self) -> int:
        return 10**self.frac_digits

    def encode(self, x: float) -> int:
        """``round(x * scale)`` as an exact signed integer."""
        value = float(x)
        if not math.isfinite(value):
            raise ValueError(f"Expected a finite value to encode, got {x!r}.")
        return _round_scaled(value, self.scale)

    def encode_many(self, values: object, name: str = "values") -> list[int]:
        scale = self.scale
        return [_round_scaled(v, scale) for v in _as_float64(values, name).ravel().tolist()]

    @staticmethod
    def to_residue(value: int, modulus: int) -> int:
        """``value mod modulus`` (a negative ``v`` becomes ``modulus - |v|``)."""
        return value % modulus

    @staticmethod
    def centered(residue: int, modulus: int) -> int:
        """The lift of ``residue`` to ``(-modulus/2, modulus/2]``."""
        residue %= modulus
        return residue - modulus if residue > modulus // 2 else residue


@dataclass(frozen=True)
class WeightingEncoding:
    """The encoding of one weighting protocol, checked for overflow at construction."""

    modulus: int
    n_max: int
    num_subjects: int
    num_silos: int
    delta_bound: float = 1.0
    noise_bound: float = 1e6
    precision: float = 1e-10
    packing: bool = True
    weight_bits: int | None = None  # k: fixed-point weights floor(2^k/n_a), L = 2^k
    codec: FixedPointCodec = field(init=False, repr=False)
    lcm: int = field(init=False, repr=False)  # L = lcm(1..n_max), or 2^k
    multiplier: int = field(init=False, repr=False)  # M = L * num_silos
    noise_scale: int = field(init=False, repr=False)  # M * 10^d
    max_encoded_delta: int = field(init=False, repr=False)
    max_encoded_noise: int = field(init=False, repr=False)
    aggregate_bound: int = field(init=False, repr=False)
    slot_bits: int = field(init=False, repr=False)
    max_slots: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.modulus
        if isinstance(n, bool) or not isinstance(n, int) or n < 3:
            raise ValueError(f"Expected modulus={n!r} to be an int >= 3.")
        for name in ("num_subjects", "num_silos"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Expected {name}={v!r} to be a positive int.")
        for name in ("delta_bound", "noise_bound"):
            check_bound(name, getattr(self, name))
        codec = FixedPointCodec(precision_digits(self.precision))
        k = self.weight_bits
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 4096):
            raise ValueError(f"Expected weight_bits={k!r} to be None or an int in [1, 4096].")
        big_l = lcm_upto(self.n_max) if k is None else 1 << k
        multiplier = big_l * self.num_silos
        noise_scale = multiplier * codec.scale
        if 4 * self.n_max * self.n_max >= n:
            raise EncodingOverflowError(f"n_max={self.n_max} is not far below the modulus.")
        e_delta = math.ceil(Fraction(self.delta_bound) * codec.scale)
        e_noise = math.ceil(Fraction(self.noise_bound) * noise_scale)
        bound = multiplier * self.num_subjects * e_delta + self.num_silos * e_noise
        if 2 * bound >= n:
            raise EncodingOverflowError(
                f"Fixed-point aggregate could wrap around the {n.bit_length()}-bit modulus: "
                f"2 * (L * S * A * E_delta + S * E_noise) has {(2 * bound).bit_length()} bits "
                f"with L = {f'lcm(1..{self.n_max})' if k is None else f'2^{k}'} "
                f"({big_l.bit_length()} bits), "
                f"A={self.num_subjects}, S={self.num_silos}, delta_bound={self.delta_bound}, "
                f"noise_bound={self.noise_bound}, precision={self.precision}. Use a larger key, "
                "a smaller n_max, coarser precision or tighter bounds."
            )
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "lcm", big_l)
        object.__setattr__(self, "multiplier", multiplier)
        object.__setattr__(self, "noise_scale", noise_scale)
        object.__setattr__(self, "max_encoded_delta", e_delta)
        object.__setattr__(self, "max_encoded_noise", e_noise)
        object.__setattr__(self, "aggregate_bound", bound)
        slot_bits = (2 * bound + 1).bit_length()
        slots = 1
        if self.packing:
            room = max(bound, 1)  # bound 0 (all values 0) still packs finitely many slots
            while 2 * room * sum(1 << (slot_bits * k) for k in range(slots + 1)) < n:
                slots += 1
        object.__setattr__(self, "slot_bits", slot_bits)
        object.__setattr__(self, "max_slots", slots)

    @property
    def scale(self) -> int:
        return self.codec.scale

    def check_slots(self, slots: int) -> int:
        """``slots`` if it is an int in ``[1, max_slots]``."""
        top = self.max_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= top:
            raise ValueError(f"Expected slots={slots!r} in [1, {self.max_slots}].")
        return slots

    def packed_bound(self, slots: int) -> int:
        """The largest ``|P|`` of an honest plaintext packing ``slots`` digits (``< n / 2``)."""
        self.check_slots(slots)
        return self.aggregate_bound * sum(1 << (self.slot_bits * k) for k in range(slots))

    def unpack(self, value: int, slots: int) -> list[int]:
        """The ``slots`` balanced digits of a centred packed plaintext (lowest first); refuses
        a value no honest aggregate can produce."""
        if abs(value) > self.packed_bound(slots):
            raise ValueOutOfRangeError(
                f"Decrypted packed aggregate of {abs(value).bit_length()} bits exceeds the "
                f"{self.packed_bound(slots).bit_length()}-bit bound: inputs were inconsistent."
            )
        if slots == 1:
            return [value]
        bits, base = self.slot_bits, 1 << self.slot_bits
        half, mask = base >> 1, base - 1
        digits = []
        for _ in range(slots):
            digit = value & mask
            if digit >= half:
                digit -= base
            digits.append(digit)
            value = (value - digit) >> bits
        if value:
            raise ValueOutOfRangeError("Decrypted packed aggregate has digits beyond its slots.")
        return digits

    @property
    def headroom_bits(self) -> int:
        """Bits between the worst-case aggregate and ``n / 2``."""
        return (self.modulus // 2).bit_length() - self.aggregate_bound.bit_length()

    @property
    def max_abs_error(self) -> float:
        """Worst-case decoding error from rounding the inputs (before float64 rounding), and
        from the fixed-point weights' floor with ``weight_bits``."""
        error = self.num_subjects / (2 * self.scale) + self.num_silos / (2 * self.noise_scale)
        if self.weight_bits is not None:
            error += self.num_subjects * self.n_max * self.delta_bound / 2.0**self.weight_bits
        return error

    def check_subject_count(self, count: int, subject: object = None) -> int:
        """``count`` if it is an int in ``[0, n_max]``; a larger one is refused."""
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
            raise ValueError(
                f"Expected a record count >= 0 for subject {subject!r}, got {count!r}."
            )
        if count > self.n_max:
            raise SubjectBoundError(
                f"Subject {subject!r} has {count} records > n_max={self.n_max}: its weight "
                f"n_s,a/n_a would not be encoded correctly (a multiple of 1/L, or X^n_a with "
                "fixed-point weights). Drop excess records or raise n_max."
            )
        return int(count)

    def _encode_bounded(self, values: object, bound: float, name: str, scale: int) -> list[int]:
        arr = _as_float64(values, name)
        if arr.size and float(np.abs(arr).max()) > bound:
            worst = float(arr.ravel()[int(np.abs(arr).argmax())])
            raise ValueOutOfRangeError(
                f"{name} value {worst!r} exceeds the bound {bound} declared at set-up."
            )
        return [_round_scaled(v, scale) for v in arr.ravel().tolist()]

    def encode_deltas(self, values: object) -> list[int]:
        """Exact signed encodings ``round(x 10^d)`` of clipped model-delta coordinates (they
        enter the aggregate multiplied by the integer weight ``n_{s,a} M / n_a``)."""
        return self._encode_bounded(values, self.delta_bound, "delta", self.scale)

    def encode_deltas_array(self, values: object) -> np.ndarray:
        """:meth:`encode_deltas` as an int64 array, vectorised (same values, exact)."""
        arr = _as_float64(values, "delta")
        if arr.size and float(np.abs(arr).max()) > self.delta_bound:
            self.encode_deltas(arr)  # raises, naming the value
        try:
            return round_scaled_array(arr, self.codec.frac_digits)
        except ValueError:
            return np.array(self.encode_deltas(arr), dtype=object)

    def encode_noise(self, values: object) -> list[int]:
        """Exact signed encodings ``round(z M 10^d)`` of real noise coordinates on the
        aggregate's grid. Rounding a float does not give an exact rounded Gaussian: a DP
        release draws its noise on the grid instead (:meth:`check_encoded_noise`)."""
        return self._encode_bounded(values, self.noise_bound, "noise", self.noise_scale)

    def silo_noise_scale(self, *, noise_multiplier: float, sensitivity: float) -> Fraction:
        """The std ``a`` of one silo's noise on the grid ``1 / (M 10^d)``: the smallest
        multiple of ``2^-64`` with ``sqrt(S) a >= σ Δ M 10^d``, so the decoded sum of the ``S``
        silos' continuous noise has std at least ``σ Δ`` (module docstring)."""
        for name, value in (("noise_multiplier", noise_multiplier), ("sensitivity", sensitivity)):
            check_bound(name, value)
        total = Fraction(noise_multiplier) * Fraction(sensitivity) * self.noise_scale
        shift = 64
        # a^2 >= total^2 / S, on the 2^-64 grid: a 2^64 = ceil(sqrt(total^2 4^64 / S))
        square = total * total * (1 << (2 * shift)) / self.num_silos
        root = math.isqrt(math.ceil(square))
        if root * root < square:
            root += 1
        return Fraction(root, 1 << shift)

    def check_encoded_noise(self, values: object) -> list[int]:
        """Noise already on the aggregate's grid (integers ``round(y)``, e.g. exact rounded
        Gaussian samples) as Python ints; refuses non-integers and values beyond the declared
        ``noise_bound`` (:class:`~silodp.crypto.errors.ValueOutOfRangeError`). A list of Python
        ints (as :meth:`encode_noise` returns) is read as it is: numpy would turn one holding
        a negative value and one at or above 2^63 into floats."""
        if isinstance(values, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
        else:
            arr = np.asarray(values)
        if arr.ndim != 1 or not (arr.dtype.kind in "iu" or arr.dtype == object):
            raise ValueError(
                f"Expected encoded noise as a 1-d array of integers, got {arr.dtype} {arr.shape}."
            )
        out: list[int] = []
        for v in arr.tolist():
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise ValueError(f"Expected integer encoded noise, got {v!r}.")
            v = int(v)
            if abs(v) > self.max_encoded_noise:
                raise ValueOutOfRangeError(
                    f"encoded noise of {abs(v).bit_length()} bits exceeds the bound "
                    f"{self.noise_bound} declared at set-up."
                )
            out.append(v)
        return out

    def decode(self, residue: int) -> float:
        """The real value of a decrypted aggregate ``L * sum`` (exactly rounded to float64)."""
        return self.decode_signed(FixedPointCodec.centered(int(residue), self.modulus))

    def decode_signed(self, value: int) -> float:
        """As :meth:`decode` for an already centred integer."""
        if abs(value) > self.aggregate_bound:
            raise ValueOutOfRangeError(
                f"Decrypted aggregate of {abs(value).bit_length()} bits exceeds the "
                f"{self.aggregate_bound.bit_length()}-bit bound: inputs were inconsistent."
            )
        return value / self.noise_scale

    def decode_many(self, residues: list[int]) -> np.ndarray:
        return np.array([self.decode(r) for r in residues], dtype=np.float64)
