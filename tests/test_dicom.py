"""DICOM folders written by pydicom: known values through the modality LUT, the window and MONOCHROME1,
resized like any image; each mistake is one DataError line naming the file and no patient data."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

import fedlt.data.dicom
from fedlt.data.dicom import DicomFiles, load_dicom_folder, read_dicom_folder
from fedlt.data.files import load_dataset, open_source
from fedlt.data.images import ImageSettings
from fedlt.errors import DataError

PATIENT = "SECRET^PATIENT"
CT = np.array([[0, 100], [200, 300]], np.int16)  # stored values; x2 - 1024 gives -1024, -824, -624, -424 HU


def _write(
    path: Path,
    pixels: np.ndarray | None = CT,
    *,
    photometric: str = "MONOCHROME2",
    rescale: tuple[float, float] | None = (2.0, -1024.0),
    preamble: bool = True,
    **tags: object,
) -> Path:
    """An uncompressed little-endian CT image carrying a patient's name and id, as a scanner writes one."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), Dataset(), file_meta=meta, preamble=b"\0" * 128 if preamble else None)
    ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
    ds.PatientName, ds.PatientID = PATIENT, "SECRET-ID-42"
    if pixels is not None:
        ds.Rows, ds.Columns = pixels.shape[-2:]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
        ds.BitsAllocated = ds.BitsStored = 8 * pixels.itemsize
        ds.HighBit = ds.BitsStored - 1
        ds.PixelRepresentation = int(pixels.dtype.kind == "i")
        ds.PixelData = pixels.tobytes()
    if rescale is not None:
        ds.RescaleSlope, ds.RescaleIntercept = rescale
    for name, value in tags.items():
        setattr(ds, name, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def _labels(folder: Path, rows: str) -> None:
    (folder / "labels.csv").write_text("file,label\n" + rows)


def _one(tmp_path: Path, **kwargs: object) -> DicomFiles:
    _write(tmp_path / "scan.dcm", **kwargs)
    _labels(tmp_path, "scan.dcm,lung\n")
    return read_dicom_folder(tmp_path)


def _refused(path: Path, match: str) -> pytest.RaisesExc:
    """One line that names the file and says `match`, never the patient's name or id."""
    return pytest.raises(DataError, match=rf"^(?!.*SECRET)[^\n]*{re.escape(path.name)}[^\n]*{match}[^\n]*$")


# --- known values ---------------------------------------------------------------------------


def test_rescale_then_window_gives_known_values(tmp_path):
    """HU -1024, -824, -624, -424 in the window [-724, 400] (-924 .. -524): clipped, 1/4, 3/4, clipped."""
    data = _one(tmp_path).prepared((1, 2, 2), ImageSettings(window=(-724.0, 400.0)))
    np.testing.assert_allclose(data.x[0, 0], [[0.0, 0.25], [0.75, 1.0]], atol=1e-7)
    assert (data.classes, data.y.tolist()) == (("lung",), [0])


def test_without_a_window_each_image_spans_its_own_range(tmp_path):
    data = _one(tmp_path).prepared((1, 2, 2), ImageSettings())
    np.testing.assert_allclose(data.x[0, 0], [[0.0, 1 / 3], [2 / 3, 1.0]], atol=1e-7)


def test_monochrome1_is_inverted_after_the_window(tmp_path):
    data = _one(tmp_path, photometric="MONOCHROME1").prepared(
        (1, 2, 2), ImageSettings(window=(-724.0, 400.0))
    )
    np.testing.assert_allclose(data.x[0, 0], [[1.0, 0.75], [0.25, 0.0]], atol=1e-7)


def test_unsigned_values_without_rescale_tags(tmp_path):
    pixels = np.array([[1000, 3000]], np.uint16)
    data = _one(tmp_path, pixels=pixels, rescale=None).prepared(
        (1, 1, 2), ImageSettings(window=(2000.0, 4000.0))
    )
    np.testing.assert_allclose(data.x[0, 0], [[0.25, 0.75]], atol=1e-7)


def test_a_wide_scan_is_cropped_and_replicated_like_any_image(tmp_path):
    """8x4 with a bright left half, cropped to 4x4 at scale 1: columns 2..6, the left half of them bright."""
    pixels = np.zeros((4, 8), np.int16)
    pixels[:, :4] = 1000
    x = _one(tmp_path, pixels=pixels).prepared((3, 4, 4), ImageSettings(resize="crop")).x[0]
    expected = np.zeros((4, 4), np.float32)
    expected[:, :2] = 1.0
    for plane in x:
        np.testing.assert_array_equal(plane, expected)


def test_a_folder_of_sizes_and_subfolders_prepares_to_the_plans_shape(tmp_path):
    _write(tmp_path / "b" / "small.dcm", CT)
    _write(tmp_path / "a" / "wide.dcm", np.arange(60, dtype=np.int16).reshape(5, 12))
    _write(
        tmp_path / "a" / "no_suffix", np.arange(49, dtype=np.uint16).reshape(7, 7)
    )  # found by its preamble
    (tmp_path / "notes.txt").write_text("not an image")
    _labels(tmp_path, "./a/wide.dcm, nodule\na/no_suffix,clear\nb/small.dcm,nodule\n")
    files = open_source(tmp_path)
    assert isinstance(files, DicomFiles)
    assert (len(files), files.classes, files.source) == (3, ("clear", "nodule"), str(tmp_path))
    plan = ((1, 6, 6), ImageSettings(resize="pad", window=(-900.0, 500.0)))
    data = files.prepared(*plan)
    assert data.x.shape == (3, 1, 6, 6)
    assert data.x.min() >= 0.0
    assert data.x.max() <= 1.0
    assert data.y.tolist() == [0, 1, 1]  # a/no_suffix, a/wide.dcm, b/small.dcm
    assert data.x.tobytes() == files.prepared(*plan).x.tobytes()


def test_labels_may_live_elsewhere(tmp_path):
    _write(tmp_path / "images" / "scan.dcm")
    (tmp_path / "y.csv").write_text("label,file,site\nlung,scan.dcm,3\n")
    assert read_dicom_folder(tmp_path / "images", labels=tmp_path / "y.csv").classes == ("lung",)


def test_load_dataset_takes_dicom_at_its_own_size(tmp_path):
    _write(tmp_path / "scan.dcm")
    _labels(tmp_path, "scan.dcm,lung\n")
    data = load_dataset(tmp_path)
    assert data.input_shape == (1, 2, 2)
    np.testing.assert_allclose(data.x[0, 0], [[0.0, 1 / 3], [2 / 3, 1.0]], atol=1e-7)
    odd = _write(tmp_path / "z_odd.dcm", np.zeros((3, 2), np.int16))
    _labels(tmp_path, "scan.dcm,lung\nz_odd.dcm,lung\n")
    with _refused(odd, "2x3 but .*scan.dcm is 2x2; all images must have the same size"):
        load_dicom_folder(tmp_path)


# --- one line per mistake -------------------------------------------------------------------


def test_a_file_without_pixel_data(tmp_path):
    empty = _write(tmp_path / "report.dcm", None, rescale=None)
    _labels(tmp_path, "report.dcm,x\n")
    with _refused(empty, "has no pixel data"):
        read_dicom_folder(tmp_path)


def test_a_file_in_the_csv_that_is_missing(tmp_path):
    _write(tmp_path / "scan.dcm")
    _labels(tmp_path, "scan.dcm,lung\ngone.dcm,lung\n")
    with _refused(tmp_path / "gone.dcm", r"listed in labels.csv \(line 3\) but missing"):
        read_dicom_folder(tmp_path)


def test_a_file_in_the_csv_that_is_not_dicom(tmp_path):
    _write(tmp_path / "scan.dcm")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG")
    _labels(tmp_path, "scan.dcm,lung\nphoto.png,lung\n")
    with _refused(tmp_path / "photo.png", "is not a DICOM file"):
        read_dicom_folder(tmp_path)


def test_a_dicom_file_with_no_row(tmp_path):
    _write(tmp_path / "scan.dcm")
    stray = _write(tmp_path / "sub" / "stray.dcm")
    _labels(tmp_path, "scan.dcm,lung\n")
    with _refused(stray, "has no row in .*labels.csv; add a line 'sub/stray.dcm,<label>'"):
        read_dicom_folder(tmp_path)


def test_an_unreadable_file(tmp_path):
    junk = tmp_path / "junk.dcm"
    junk.write_bytes(b"not a DICOM file at all")
    _labels(tmp_path, "junk.dcm,x\n")
    with _refused(junk, "not a DICOM file") as raised:
        read_dicom_folder(tmp_path)
    assert "force" not in str(raised.value)  # pydicom's advice to read it anyway


def test_pixel_data_shorter_than_the_header_says(tmp_path):
    files = _one(tmp_path, Rows=40)
    with _refused(tmp_path / "scan.dcm", "cannot decode the DICOM pixel data"):
        files.prepared((1, 4, 4), ImageSettings(resize="stretch"))


@pytest.mark.parametrize(
    ("tags", "match"),
    [
        ({"NumberOfFrames": 3}, "has 3 frames"),
        ({"PhotometricInterpretation": "RGB", "SamplesPerPixel": 3}, "photometric interpretation RGB"),
    ],
)
def test_multi_frame_and_colour_are_refused(tmp_path, tags, match):
    scan = _write(tmp_path / "scan.dcm", **tags)
    _labels(tmp_path, "scan.dcm,x\n")
    with _refused(scan, match):
        read_dicom_folder(tmp_path)


@pytest.mark.parametrize(
    ("csv", "match"),
    [
        (None, r"no such file: a DICOM folder.s labels are a CSV \(columns file,label\)"),
        ("path,label\nscan.dcm,x\n", "needs columns 'file' and 'label'; missing file"),
        ("file,label\nscan.dcm,\n", "line 2: empty label"),
        ("file,label\nscan.dcm,x\n./scan.dcm,y\n", r"listed twice in labels.csv \(lines 2 and 3\)"),
        ("", "cannot read as CSV"),
    ],
)
def test_a_bad_labels_file(tmp_path, csv, match):
    _write(tmp_path / "scan.dcm")
    if csv is not None:
        (tmp_path / "labels.csv").write_text(csv)
    with pytest.raises(DataError, match=rf"^[^\n]*{match}[^\n]*$"):
        read_dicom_folder(tmp_path)


def test_a_folder_without_dicom(tmp_path):
    with pytest.raises(DataError, match="no DICOM files"):
        read_dicom_folder(tmp_path)


def test_without_pydicom_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(fedlt.data.dicom, "pydicom", None)
    with pytest.raises(DataError, match=r"pip install 'fedlt\[dicom\]'"):
        read_dicom_folder(tmp_path)
