"""The dashboard in a real headless browser: Debian's chromium, driven by Selenium through
chromium-driver, against the dashboard served by uvicorn on a free port of 127.0.0.1.

When chromium or chromedriver is missing it is installed (Debian's packages, with apt-get)
if the tests run as root; otherwise these tests are skipped, saying why.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from dashboard_data import Seeded, seed, statuses
from debian_packages import install_debian_package
from models import EmailJob, EmailJobResult

uvicorn = pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

from sqla_jobs.dashboard import create_app  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
DEADLINE = 20.0  # seconds to wait for a page or the server, never a measured time


def _install_chromium() -> str | None:
    """Install Debian's chromium and chromium-driver when missing and we are root; return
    why they cannot be had, or None when they are there."""
    present = os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)
    reason = install_debian_package("chromium", "chromium-driver", present=present)
    if reason is None and not os.path.exists(CHROMEDRIVER):
        reason = f"chromium-driver was installed, but {CHROMEDRIVER} is missing"
    return reason


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    reason = _install_chromium()
    if reason is not None:
        pytest.skip(reason)
    options = Options()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root has no user namespace sandbox here
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,800",
    ):
        options.add_argument(argument)
    # Both paths are given: Selenium Manager has nothing to look up or download.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(DEADLINE)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def dashboard_url(_queue_database: sa.Engine) -> Iterator[str]:
    """The dashboard of tests/models.py's EmailJob table, served by uvicorn in a thread on a
    free port (the socket is bound first, so no other process can take the port)."""
    app = create_app(_queue_database, EmailJob, result_model=EmailJobResult)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped before it started"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(DEADLINE)
        sock.close()


def wait_for(driver: WebDriver, css: str) -> None:
    WebDriverWait(driver, DEADLINE).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
    )


def open_job_from_list(driver: WebDriver, base: str, query: str, job_id: int) -> None:
    driver.get(f"{base}/jobs?{query}")
    wait_for(driver, "#jobs")
    driver.find_element(By.CSS_SELECTOR, f'tr[data-job-id="{job_id}"] a').click()
    wait_for(driver, "#job-status")
    assert driver.find_element(By.TAG_NAME, "h1").text.startswith(f"Job {job_id}")


def test_click_through_retry_cancel_and_delete(
    browser: WebDriver, dashboard_url: str, queue_engine: sa.Engine
) -> None:
    seeded: Seeded = seed(queue_engine)

    # A dead job: its traceback is on the page; Retry makes it pending.
    open_job_from_list(browser, dashboard_url, "status=dead", seeded.dead)
    assert "ValueError: card <declined>" in browser.find_element(By.ID, "last-error").text
    browser.find_element(By.ID, "retry").click()
    wait_for(browser, "#notice")
    assert browser.find_element(By.ID, "job-status").text == "pending"
    assert statuses(queue_engine)[seeded.dead] == "pending"

    # A pending job: Cancel.
    open_job_from_list(browser, dashboard_url, "queue=email&status=pending", seeded.pending)
    browser.find_element(By.ID, "cancel").click()
    wait_for(browser, "#notice")
    assert browser.find_element(By.ID, "job-status").text == "cancelled"
    assert statuses(queue_engine)[seeded.pending] == "cancelled"

    # A succeeded job: Delete, behind its confirmation; the list no longer shows it.
    open_job_from_list(browser, dashboard_url, "status=succeeded", seeded.succeeded)
    assert "R-77" in browser.find_element(By.ID, "result").text
    browser.find_element(By.ID, "delete-open").click()
    browser.find_element(By.ID, "delete").click()
    wait_for(browser, "#notice")
    assert seeded.succeeded not in statuses(queue_engine)
    assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-job-id="{seeded.succeeded}"]')

    # A running job offers only Cancel (a request to its worker); an unknown one gets the
    # 404 page.
    open_job_from_list(browser, dashboard_url, "status=running", seeded.running)
    assert not browser.find_elements(By.CSS_SELECTOR, "#retry, #delete")
    assert browser.find_elements(By.CSS_SELECTOR, "#cancel")
    browser.get(f"{dashboard_url}/jobs/999999")
    wait_for(browser, "#error-message")
    assert "no job 999999" in browser.find_element(By.ID, "error-message").text

    # The filter form, with a hostile string: refused, shown escaped, nothing changed.
    before = statuses(queue_engine)
    browser.get(f"{dashboard_url}/jobs")
    wait_for(browser, "#filters")
    field = browser.find_element(By.NAME, "queue")
    field.send_keys("<img src=x onerror=alert(1)>")
    browser.find_element(By.ID, "filter").click()
    wait_for(browser, "#error-message")
    assert "bad queue filter" in browser.find_element(By.ID, "error-message").text
    assert not browser.find_elements(By.CSS_SELECTOR, "main img")
    assert statuses(queue_engine) == before


def png_pixels(data: bytes) -> tuple[int, int, list[list[bytes]]]:
    """Width, height and the rows of pixels (RGB bytes each) of an 8-bit RGB or RGBA PNG,
    decoded with the standard library (the screenshot's own format)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    position, idat, header = 8, b"", b""
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        position += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert (depth, interlace) == (8, 0), "unexpected PNG format"
    assert color in (2, 6), "unexpected PNG format"
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[list[bytes]] = []
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind_of_filter = raw[start]
        line = bytearray(raw[start + 1 : start + 1 + stride])
        for x in range(stride):
            left = line[x - bpp] if x >= bpp else 0
            up = previous[x]
            corner = previous[x - bpp] if x >= bpp else 0
            if kind_of_filter == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind_of_filter == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind_of_filter == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind_of_filter == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                predictor = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[x] = (line[x] + predictor) & 0xFF
        rows.append([bytes(line[x : x + 3]) for x in range(0, stride, bpp)])
        previous = line
    return width, height, rows


def colour_near(pixel: bytes, colour: tuple[int, int, int], tolerance: int = 40) -> bool:
    return all(abs(have - want) <= tolerance for have, want in zip(pixel, colour, strict=True))


SUCCEEDED_GREEN = (0x06, 0x76, 0x47)  # the charts' bars, a time-left bar (_widgets.html)
DEPTH_BLUE = (0x2F, 0x5B, 0xEA)  # the depth line's stroke, a progress bar


def test_screenshot_of_the_overview_is_a_real_page(
    browser: WebDriver, dashboard_url: str, queue_engine: sa.Engine, tmp_path: Path
) -> None:
    seed(queue_engine)
    browser.get(dashboard_url + "/")
    wait_for(browser, "#queues")
    # The expected elements: the header, one row per queue, no error.
    queues = [
        row.get_attribute("data-queue")
        for row in browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr")
    ]
    assert queues == ["billing", "email"]
    assert browser.find_element(By.ID, "nav-jobs").is_displayed()
    assert not browser.find_elements(By.ID, "error-message")
    # The page's own styles were applied (the Content-Security-Policy let them through).
    header = browser.find_element(By.TAG_NAME, "header")
    assert header.value_of_css_property("background-color") == "rgba(16, 24, 40, 1)"

    path = Path(os.environ.get("SQLA_JOBS_SCREENSHOT_DIR", tmp_path)) / "dashboard-overview.png"
    try:
        assert browser.save_screenshot(str(path))
    except WebDriverException as exc:  # pragma: no cover - says what went wrong
        pytest.fail(f"no screenshot: {exc}")
    width, height, rows = png_pixels(path.read_bytes())
    assert width >= 600
    assert height >= 400
    # Not blank: the page's background is the most common colour, but far from all of it,
    # and the text, the header and the status colours make many colours in all.
    step = 4
    sample = [pixel for row in rows[::step] for pixel in row[::step]]
    counts: dict[bytes, int] = {}
    for pixel in sample:
        counts[pixel] = counts.get(pixel, 0) + 1
    commonest = max(counts.values())
    assert len(counts) >= 20, f"only {len(counts)} colours: a blank or broken page ({path})"
    assert commonest < 0.95 * len(sample), f"the page is almost uniform ({path})"
    # The running job's pictures, drawn: its progress bar (40%) and the time left to its
    # limit (40 of 60 s), each in its colour.
    for cell, colour in (("progress", DEPTH_BLUE), ("time-left", SUCCEEDED_GREEN)):
        bar = browser.find_element(By.CSS_SELECTOR, f"#running td.{cell} svg.bar")
        path = path.with_name(f"dashboard-running-{cell}.png")
        path.write_bytes(bar.screenshot_as_png)
        _, _, rows = png_pixels(path.read_bytes())
        drawn = sum(colour_near(pixel, colour) for row in rows for pixel in row)
        assert drawn >= 100, f"the running job's {cell} bar is empty ({path})"


def test_screenshot_of_the_charts_shows_their_series(
    browser: WebDriver, dashboard_url: str, queue_engine: sa.Engine, tmp_path: Path
) -> None:
    """The activity page's charts, drawn: a screenshot of each chart element holds pixels of
    its series' colour, over many rows of pixels (an empty or undrawn chart has only its
    background and axis, or a flat line at the bottom)."""
    with queue_engine.begin() as connection:
        for minutes in range(0, 30, 3):  # a job succeeded every 3 minutes, the last half hour
            connection.execute(
                sa.insert(EmailJob).values(
                    queue="email",
                    task="send_receipt",
                    status="succeeded",
                    attempts=1,
                    created_at=sa.text(f"now() - interval '{minutes + 1} minutes'"),
                    finished_at=sa.text(f"now() - interval '{minutes} minutes'"),
                )
            )
        for _ in range(3):  # and three waiting now
            connection.execute(sa.insert(EmailJob).values(queue="email", task="send_receipt"))
    browser.get(dashboard_url + "/activity")
    wait_for(browser, "#activity")
    card = browser.find_element(By.CSS_SELECTOR, 'section[data-queue="email"]')
    folder = Path(os.environ.get("SQLA_JOBS_SCREENSHOT_DIR", tmp_path))
    for kind, colour in (("throughput", SUCCEEDED_GREEN), ("depth", DEPTH_BLUE)):
        chart = card.find_element(By.CSS_SELECTOR, f"svg.chart.{kind}")
        assert chart.size["width"] >= 200
        path = folder / f"dashboard-chart-{kind}.png"
        path.write_bytes(chart.screenshot_as_png)
        _, _, rows = png_pixels(path.read_bytes())
        drawn = [sum(colour_near(pixel, colour) for pixel in row) for row in rows]
        assert sum(drawn) >= 50, f"the {kind} chart shows no series ({path})"
        tall = sum(1 for count in drawn if count)
        assert tall >= 20, f"the {kind} chart is flat: {tall} rows of its colour ({path})"
    # The failing jobs page answers too, from the nav.
    browser.find_element(By.ID, "nav-failures").click()
    wait_for(browser, "h1")
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Failing jobs")
