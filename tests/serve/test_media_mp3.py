"""MP3 clips the OpenAI ingress accepts (``serve.media.check_mp3``): real MP3 bytes encoded here
with PyAV's LAME encoder; a cut file, another format under the MP3 name and an over-long clip
are refused with the error the ingress turns into a 400."""

from __future__ import annotations

import io

import numpy as np
import pytest

av = pytest.importorskip("av", reason="PyAV (the av wheel) decodes MP3 here")

from mmtier.errors import BadMediaError  # noqa: E402
from mmtier.serve.media import TooLargeMedia, check_mp3  # noqa: E402


def mp3(seconds: float, rate: int = 16000, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    samples = (rng.standard_normal(int(seconds * rate)) * 0.2).astype(np.float32)[None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


def test_an_mp3_is_read_whole():
    info = check_mp3(mp3(1.0), 30)
    assert (info.media_type, info.rate, info.channels) == ("audio/mpeg", 16000, 1)
    assert abs(info.seconds - 1.0) < 0.1


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.8])
def test_a_cut_mp3_is_refused(cut):
    data = mp3(2.0, seed=1)
    with pytest.raises(BadMediaError, match="cut short|does not decode"):
        check_mp3(data[: int(len(data) * cut)], 30)


def test_other_bytes_under_the_mp3_name_are_refused():
    with pytest.raises(BadMediaError, match="not an MP3"):
        check_mp3(b"RIFF" + bytes(200), 30)
    with pytest.raises(BadMediaError):
        check_mp3(b"ID3" + bytes(200), 30)


def test_an_mp3_over_the_limit_is_too_large():
    with pytest.raises(TooLargeMedia):
        check_mp3(mp3(3.0), 2.0)
