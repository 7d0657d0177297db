"""The talk page in a real browser: Debian's chromium, its microphone fed from a spoken question (a WAV file),
against `metronome serve` with the speech assistant. The question is heard, the answer shown and played."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import resources

import pytest

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)",
                allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(env: dict[str, str] | None = None):
    """`metronome serve` with the speech assistant; returns (process, its page's URL) once it answers."""
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "metronome", "serve", "--port", str(port), "--worker-port", str(free_port()),
         "--budget-ms", "500", "--window", "256", "--num-blocks", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    banner, deadline = "", time.monotonic() + 300
    while "connect to" not in banner:
        line = serve.stdout.readline()
        assert line or serve.poll() is None, banner
        banner += line
        assert time.monotonic() < deadline, banner
    url = f"http://127.0.0.1:{port}"
    while True:   # the banner comes just before the gateway listens
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline and serve.poll() is None, banner
            time.sleep(0.2)
    return serve, url


@pytest.fixture(scope="module")
def server():
    serve, url = start_serve()
    yield url
    serve.terminate()
    serve.wait(timeout=60)


def spoken_question(folder) -> str:
    """The packaged France question followed by 12 s of silence, as a WAV. Chromium loops its fake microphone's
    file; the sample alone has 0.2 s of silence between loops, less than the VAD's end of a turn, so its
    repeats would run together into one 15-s utterance instead of a question and a pause. The pause is long
    enough for a slow machine to finish answering before the question comes round again and barges in."""
    import numpy as np
    import soundfile as sf

    speech, rate = sf.read(resources.files("metronome.audio") / "samples" / "01_france.wav", dtype="float32")
    path = os.path.join(folder, "question.wav")
    sf.write(path, np.concatenate([speech, np.zeros(12 * rate, np.float32)]), rate, subtype="PCM_16")
    return path


def browser(question_wav: str, profile: str):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-audio-capture={question_wav}", "--autoplay-policy=no-user-gesture-required",
                 f"--user-data-dir={profile}", "--window-size=1100,800"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def test_page_is_served_with_its_files(server):
    page = urllib.request.urlopen(server + "/", timeout=10).read().decode()
    assert "<title>Metronome</title>" in page and 'data-auth-required="false"' in page
    for name in ("app.js", "capture-worklet.js", "style.css"):
        assert urllib.request.urlopen(f"{server}/page/{name}", timeout=10).status == 200


def test_a_spoken_question_is_heard_answered_and_played(server, tmp_path):
    driver = browser(spoken_question(tmp_path), str(tmp_path / "profile"))
    try:
        driver.get(server + "/")
        driver.find_element("id", "talk").click()
        state, deadline = {}, time.monotonic() + 180
        while time.monotonic() < deadline:
            state = driver.execute_script("return window.metronomeState")
            if any("paris" in s.lower() for s in state["said"]) or state["errors"]:
                break       # an answer cut short by the looped question barging in is not the end
            time.sleep(0.5)     # polling the page, not waiting for it: the loop ends on the state itself
        assert not state["errors"], state
        assert any("capital" in h.lower() and "france" in h.lower() for h in state["heard"]), state
        assert any("paris" in s.lower() for s in state["said"]), state
        assert state["playedSamples"] > 24_000 * 0.5, state        # at least half a second of the answer's speech
        shot = os.environ.get("METRONOME_PAGE_SCREENSHOT")
        if shot:
            driver.save_screenshot(shot)
    finally:
        driver.quit()


def test_with_an_api_key_the_page_sends_it_as_a_subprotocol(tmp_path):
    """A server with --api-key: the page asks for the key and connects with it as the WebSocket subprotocol
    `openai-insecure-api-key.KEY` beside `realtime` (chromium fails a handshake whose 101 does not echo one)."""
    serve, url = start_serve({"METRONOME_API_KEY": "sk-page-test"})
    driver = browser(spoken_question(tmp_path), str(tmp_path / "profile"))
    try:
        page = urllib.request.urlopen(url + "/", timeout=10).read().decode()
        assert 'data-auth-required="true"' in page
        driver.get(url + "/")
        assert driver.find_element("id", "key-needed").is_displayed()
        driver.find_element("id", "api-key").send_keys("sk-page-test")
        driver.find_element("id", "talk").click()
        state, deadline = {}, time.monotonic() + 120
        while time.monotonic() < deadline:
            state = driver.execute_script("return window.metronomeState")
            if state["ticks"] > 0 or state["errors"]:
                break
            time.sleep(0.5)     # polling the page, not waiting for it: the loop ends on the state itself
        assert not state["errors"] and state["connected"] and state["ticks"] > 0, state
        assert driver.execute_script("return socket && socket.protocol") == "realtime"
    finally:
        driver.quit()
        serve.terminate()
        serve.wait(timeout=60)
