package extproc

import (
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// bodyChunk is a StreamedBodyResponse reply and every message around it,
// laid out together: one allocation instead of seven, and a processor
// reuses one for every response chunk (a reply is encoded by Send before
// the next message is handled).
type bodyChunk struct {
	resp     extprocv3.ProcessingResponse
	req      extprocv3.ProcessingResponse_RequestBody
	res      extprocv3.ProcessingResponse_ResponseBody
	body     extprocv3.BodyResponse
	common   extprocv3.CommonResponse
	mutation extprocv3.BodyMutation
	streamed extprocv3.BodyMutation_StreamedResponse
	chunk    extprocv3.StreamedBodyResponse
}

// set makes c the request (or response) body reply that streams data,
// with end_of_stream eos, and returns it.
func (c *bodyChunk) set(request bool, data []byte, eos bool) *extprocv3.ProcessingResponse {
	c.chunk.Body, c.chunk.EndOfStream = data, eos
	c.streamed.StreamedResponse = &c.chunk
	c.mutation.Mutation = &c.streamed
	c.common.BodyMutation = &c.mutation
	c.body.Response = &c.common
	if request {
		c.req.RequestBody = &c.body
		c.resp.Response = &c.req
	} else {
		c.res.ResponseBody = &c.body
		c.resp.Response = &c.res
	}
	return &c.resp
}

func bodyAck(request bool) *extprocv3.ProcessingResponse {
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
}
