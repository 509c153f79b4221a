"""The playground page (GET /) in headless Chromium against the real stack: the three stages and
the gateway as their own processes (`services.launcher.Stack`, the `dramaturg up` path) with the
tiny checkpoint. The test types a text, clicks Speak, and checks that streamed PCM was decoded and
scheduled for playback before the take ended, that the <audio> element holds the take, and that
TTFA, RTF and the trace link are shown. A screenshot goes to $DRAMA_TEST_ARTIFACTS (or the test's
tmp dir).

Needs Debian's `chromium` and `chromium-driver` and PyPI `selenium`; skips without them.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from gateway.routes.playground import PAGE

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                  "--window-size=1100,1000")
MAX_FRAMES = 12                  # per text chunk: a take of about half a second on the tiny model


# --------------------------------------------------------------------------------------------
# the page itself, no browser needed
# --------------------------------------------------------------------------------------------

def test_page_is_self_contained():
    """No external script, style, font or image; the only absolute URL is the Jaeger default."""
    html = PAGE.read_text()
    assert not re.search(r"<(script|img|iframe|link)\b[^>]*\b(src|href)=\"(?!data:)", html, re.I)
    assert not re.search(r"@import|url\(", html)
    assert re.findall(r"https?://[^\s\"'<]+", html) == ["http://localhost:16686"]
    for hint in ("<|speaker:0|>", "[laughs]", "<whisper>", "</whisper>"):
        assert hint.replace("<", "&lt;").replace(">", "&gt;") in html, hint


# --------------------------------------------------------------------------------------------
# the stack and the browser
# --------------------------------------------------------------------------------------------

def _chromium() -> tuple[str, str]:
    browser = next((path for path in map(shutil.which, BROWSERS) if path), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no chromium/chromedriver installed (apt-get install -y chromium chromium-driver)")
    return browser, driver


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    from services.launcher import Stack

    with Stack(checkpoint=tiny_checkpoint, port=0) as running:
        running.start(ready_timeout_s=120)
        yield running


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver")
    binary, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def artifacts(tmp_path) -> Path:
    directory = Path(os.environ.get("DRAMA_TEST_ARTIFACTS") or tmp_path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def wait_for(driver, script: str, timeout: float = 60.0):
    """Poll a JS expression until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {script};")
        if value:
            return value
        if time.monotonic() > deadline:
            state = driver.execute_script("return JSON.stringify(window.playground)")
            pytest.fail(f"timed out waiting for {script!r}; playground state {state}")
        time.sleep(0.1)


def open_page(driver, stack):
    from selenium.webdriver.common.by import By

    response = httpx.get(stack.url + "/", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    driver.get(stack.url + "/")
    wait_for(driver, "document.getElementById('voice').options.length > 1", timeout=30)
    return lambda element_id: driver.find_element(By.ID, element_id)


def severe_console_messages(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_speak_streams_and_plays(browser, stack, artifacts):
    from selenium.webdriver.support.ui import Select

    element = open_page(browser, stack)
    voices = [option.get_attribute("value") for option in Select(element("voice")).options]
    assert {"default", "alloy"} <= set(voices)

    text = element("text")
    text.clear()
    text.send_keys("<|speaker:0|>Hello from the playground. ")
    browser.find_element("css selector", ".hints button[data-open='[laughs]']").click()
    assert text.get_attribute("value") == "<|speaker:0|>Hello from the playground. [laughs]"
    Select(element("voice")).select_by_value("alloy")
    Select(element("latency")).select_by_value("low")
    assert Select(element("format")).first_selected_option.get_attribute("value") == "pcm"
    element("max-frames").send_keys(str(MAX_FRAMES))
    element("speak").click()

    wait_for(browser, "['done', 'error'].includes(window.playground.status)", timeout=60)
    state = browser.execute_script("return window.playground")
    assert state["status"] == "done", state["error"]
    assert state["sampleRate"] == 24000
    assert state["decodedSamples"] > 0 and state["bytes"] == 2 * state["decodedSamples"]
    # Playback was scheduled at the first chunk, and more chunks followed: it started before the
    # take was complete.
    assert state["chunks"] >= 2
    assert 0 < state["ttfaMs"] < state["totalMs"]
    assert state["rtf"] > 0
    assert re.fullmatch(r"[0-9a-f]{32}", state["traceId"])
    assert element("trace").get_attribute("href") == f"http://localhost:16686/trace/{state['traceId']}"
    assert element("ttfa").text.endswith(" ms") and element("rtf").text != "–"
    # The audio clock runs: the scheduled buffers are being played out.
    played = wait_for(browser, "window.playgroundAudioContext.state === 'running' && "
                               "window.playgroundAudioContext.currentTime", timeout=10)
    assert played > 0

    # The whole take is on the <audio> element afterwards.
    duration = wait_for(browser, "document.getElementById('player').readyState >= 1 && "
                                 "document.getElementById('player').duration", timeout=10)
    assert duration == pytest.approx(state["decodedSamples"] / state["sampleRate"], abs=0.01)
    assert severe_console_messages(browser) == []          # CSP violations would show here

    screenshot = artifacts / "playground.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 0


def test_errors_are_shown(browser, stack):
    element = open_page(browser, stack)
    text = element("text")
    text.clear()
    text.send_keys("<|speaker:99|>Nobody is speaker 99.")
    element("speak").click()
    wait_for(browser, "['done', 'error'].includes(window.playground.status)", timeout=30)
    assert browser.execute_script("return window.playground.status") == "error"
    assert element("status").text.startswith("Failed: 400:")
    assert "speaker" in element("status").text


@pytest.mark.parametrize("audio_format", ["mp3", "opus"])
def test_buffered_formats_play_in_the_audio_element(browser, stack, audio_format):
    from selenium.webdriver.support.ui import Select

    element = open_page(browser, stack)
    Select(element("format")).select_by_value(audio_format)
    element("max-frames").send_keys(str(MAX_FRAMES))
    element("speak").click()
    wait_for(browser, "['done', 'error'].includes(window.playground.status)", timeout=60)
    state = browser.execute_script("return window.playground")
    assert state["status"] == "done", state["error"]
    assert state["audioSeconds"] > 0 and state["rtf"] > 0 and state["ttfaMs"] > 0
    player = browser.execute_script("const a = document.getElementById('player');"
                                    "return {paused: a.paused, duration: a.duration, src: a.src}")
    assert player["src"].startswith("blob:") and player["duration"] == pytest.approx(state["audioSeconds"])
    assert not player["paused"] or browser.execute_script("return document.getElementById('player').ended")
