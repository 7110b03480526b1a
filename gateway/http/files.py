"""POST /v1/collections/{name}/files: documents uploaded as files (multipart/form-data), read as
`sluice ingest` reads them (retrieval.files): PDF, Word, HTML, Markdown, text and JSONL, the
type from the content first and the name second, the file name as the document id, so a file
uploaded again under its name replaces (or, unchanged, skips) the one stored."""
from __future__ import annotations

from typing import Annotated

from litestar import Request, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.enums import RequestEncodingType
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Body, Parameter

from gateway.errors import ErrorBody, GatewayError, documented
from gateway.http import schemas as s
from gateway.tenants import Tenant
from retrieval import File
from retrieval.files import KINDS

CollectionPath = Annotated[str, Parameter(pattern=s.COLLECTION_NAME, description=s.COLLECTION_NAME_RULE)]
REFUSALS = {
    413: "A file is over the tenant's `limits.max_file_bytes` (code `file_too_large`), or the body is over the "
         "server's `max_upload_bytes`.",
    415: "The body is not `multipart/form-data`.",
    422: "A file is empty, of a type that cannot be read (code `file_unsupported_type`: not UTF-8 text, PDF or "
         "Word, an unknown suffix, an old binary .doc or a password-protected Word file), a PDF is damaged, "
         "encrypted or has no text layer (a scan: no OCR), a Word file is damaged or a ZIP bomb, a name appears "
         "twice, a part has no file name, or the form holds no part. `message` names the file; the collection "
         "is left exactly as it was.",
}


async def _parts_first(request: Request) -> None:
    """Refuse a body that is not a form, a form with no part, or a part that is not a named file,
    before Litestar reads the form into the handler's list (an empty form fails inside Litestar,
    a text part as a missing body)."""
    if request.content_type[0] != "multipart/form-data":
        raise GatewayError(415, "send the files as multipart/form-data", code="unsupported_media_type")
    form = await request.form()
    if not form:
        raise GatewayError(422, "the form holds no files", "files", "no_files")
    for i, (field, value) in enumerate(form.multi_items()):
        if not isinstance(value, UploadFile) or not value.filename:
            raise GatewayError(422, f"part {i + 1} of the form ({field!r}) is not a file with a file name", "files",
                               "not_a_file")


def upload_route(max_upload_bytes: int):
    """The handler, with the server's limit on a whole upload's body."""

    @post("/collections/{name:str}/files", status_code=200, request_max_body_size=max_upload_bytes,
          before_request=_parts_first,
          summary="Add or replace documents uploaded as files (created on first use)",
          description="`multipart/form-data` with one or more file parts (any field name), each a document whose "
                      f"id is its file name. Types read: {', '.join(sorted(KINDS))} (by content first, then name). "
                      "A file whose bytes are unchanged is skipped (`unchanged`); a changed one replaces all its "
                      "old chunks at once, so a search sees the old version or the new one.",
          responses={**documented(400, 401, 429, 503),
                     **{k: ResponseSpec(ErrorBody, description=v, generate_examples=False)
                        for k, v in REFUSALS.items()}})
    async def upload_files(request: Request, name: CollectionPath, tenant: NamedDependency[Tenant],
                           data: Annotated[list[UploadFile], Body(media_type=RequestEncodingType.MULTI_PART)]
                           ) -> s.IngestResponse:
        files = [File(upload.filename, await upload.read()) for upload in data]
        return await request.app.state.gateway.ingest_files(tenant, name, files)

    return upload_files
