// Package envoy holds kvbandit's Envoy bootstrap configurations and the code that renders and
// checks them.
//
// # Files
//
// sidecar.yaml runs kvbandit as the endpoint picker with the request body in
// FULL_DUPLEX_STREAMED mode, the primary mode; buffered.yaml is the same with the request body
// BUFFERED. Both are generated from bootstrap.yaml.tmpl by [Render] with the example options
// (workers 127.0.0.1:8001 and 127.0.0.1:8002, kvbandit on 127.0.0.1:9002, health on 9003, the
// listener on 127.0.0.1:8081). A test keeps the checked-in files equal to Render's output:
//
//	go test ./envoy -update   # rewrite sidecar.yaml and buffered.yaml after editing the template
//
// docs/envoy.md explains the settings.
//
// eds.yaml is hand-written: sidecar.yaml with the worker cluster of type EDS, fed by kvbandit's
// EDS server (package routing/discovery/eds, on 127.0.0.1:18000 through cluster kvbandit_xds) for
// dynamic discovery. A test keeps everything else in it equal to sidecar.yaml; docs/eds.md
// explains it.
//
// # Validation
//
// No Envoy binary is available to load a config, so [Validate] checks one against Envoy's own
// protos instead: the YAML is decoded into a bootstrap proto (unknown fields and bad enum values
// are errors), then every message is checked with its protoc-gen-validate rules, including the
// messages packed in google.protobuf.Any fields (typed_config and friends), which the generated
// ValidateAll methods do not look into. Errors name the full path through the config, Any
// contents included. On top of that, Validate enforces the rules that make an endpoint-picker
// deployment safe and complete (see [Validate]); each broken rule is reported as an error that
// matches one of the Err* sentinels with [errors.Is].
//
// Validate resolves Any contents through the global protobuf registry. This package registers
// (by importing them) the extension protos its configs use; a config with any other extension
// needs that proto package imported by the caller.
package envoy
